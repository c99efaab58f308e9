"""Incremental detokenization and stop-string matching for one request's output stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.protocol.tokenizer import rust_backend


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back bytes of an unfinished UTF-8 character and the
    tail that could still turn into a stop string, so streamed text never has to be taken back."""

    tokenizer: object
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all decoded text so far (including any held-back tail)
    emitted: int = 0  # characters of `text` already released to the client
    prefix_offset: int = 0
    read_offset: int = 0
    _backend: object = None  # the Rust tokenizer, when it decodes exactly as the wrapper
    _stream: object = None  # its incremental decoder (one Rust call a token)
    _stopped: bool = False  # text was cut at a stop string

    def __post_init__(self) -> None:
        self._backend = rust_backend(self.tokenizer)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece
            return
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)

    def find_stop(self) -> str | None:
        """The stop string now present in the unreleased text, if any; truncates text at it."""
        if not self.stop:
            return None
        search_from = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, search_from)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self._stopped = True
        self.text = (
            self.text[: pos + len(s)] if self.include_stop_str_in_output else self.text[:pos]
        )
        return s

    def release(self, final: bool) -> str:
        """Text safe to send now; on the final call, everything left (including a trailing
        U+FFFD that was held back in case the next token completed a character)."""
        if final and not self._stopped and self.token_ids:
            full = self._decode(self.token_ids)
            if len(full) > len(self.text) and full.startswith(self.text):
                self.text = full
        end = len(self.text)
        if not final and self.stop and not self.include_stop_str_in_output:
            hold = max(len(s) for s in self.stop) - 1
            end = max(self.emitted, end - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
