"""`--speculative-config`: vLLM's JSON, parsed and validated with the offending key named.

Methods kvmesh runs: ngram (prompt lookup over the request's own tokens), mtp (the target's
next-n prediction layers, or an MTP head file given as `model`), draft_model (a smaller model
sharing the tokenizer) and eagle (an EAGLE-1 head directory given as `model`); eagle3 parses
but the engine refuses it when it loads the head. The model-specific MTP names vLLM once
accepted (deepseek_mtp, qwen3_next_mtp, ...) normalise to mtp. Methods vLLM has and kvmesh does
not (medusa, suffix, ...) and keys for features kvmesh lacks are refused, not ignored, so a
config never silently means less than it says.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "mtp", "draft_model", "eagle", "eagle3")
_MTP_ALIASES = (
    "deepseek_mtp",
    "qwen3_next_mtp",
    "glm4_moe_mtp",
    "mimo_mtp",
    "ernie_mtp",
    "longcat_flash_mtp",
    "pangu_ultra_moe_mtp",
)
_VLLM_ONLY_METHODS = (
    "ngram_gpu",
    "medusa",
    "mlp_speculator",
    "suffix",
    "custom_class",
    "extract_hidden_states",
    "dflash",
    "dspark",
)
# vLLM keys for features kvmesh does not have: refused with their name
_UNSUPPORTED_KEYS = (
    "speculative_token_tree",
    "parallel_drafting",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
_PROMPT_LOOKUP_DEFAULT = 5  # vLLM: both bounds default to 5 when neither is given


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None  # mtp: defaults to num_nextn_predict_layers
    model: str | None = None  # draft model / head path; mtp without it reuses the target
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    disable_by_batch_size: int | None = None  # speculate only while running requests < this
    draft_tensor_parallel_size: int | None = None  # kvmesh drafts on one rank: 1 or unset
    max_model_len: int | None = None  # the draft's own limit; drafting stops beyond it
    quantization: str | None = None  # kvmesh loads drafts unquantised: must stay unset
    revision: str | None = None
    code_revision: str | None = None
    enforce_eager: bool | None = None  # accepted; kvmesh always runs eagerly
    disable_padded_drafter_batch: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.method in _MTP_ALIASES:
            self.method = "mtp"
        if self.method in _VLLM_ONLY_METHODS:
            raise ValueError(f"method {self.method!r} is not supported by kvmesh; use {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {METHODS}")
        k = self.num_speculative_tokens
        if k is not None and k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if k is None and self.method != "mtp":
            raise ValueError(f"num_speculative_tokens is required for method {self.method!r}")
        if self.method == "ngram":
            self._resolve_prompt_lookup()
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies to method 'ngram' only")
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f"model is required for method {self.method!r}")
        if self.method == "ngram" and self.model not in (None, "ngram", "[ngram]"):
            raise ValueError("model must be unset for method 'ngram'")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(
                f"disable_by_batch_size must be >= 2, got {self.disable_by_batch_size}"
            )
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError("draft_tensor_parallel_size must be 1: kvmesh drafts on one rank")
        if self.quantization is not None:
            raise ValueError("quantization is not supported for drafts")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    def _resolve_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = _PROMPT_LOOKUP_DEFAULT
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if lo < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {lo}")
        if hi < 1:
            raise ValueError(f"prompt_lookup_max must be >= 1, got {hi}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(raw)}")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key in _UNSUPPORTED_KEYS:
                raise ValueError(f"speculative config key {key!r} is not supported by kvmesh")
            if key not in known:
                raise ValueError(f"unknown speculative config key {key!r}; known: {sorted(known)}")
        args = dict(raw)
        if args.get("method") is None:
            args["method"] = _infer_method(args.get("model"))
        return cls(**args)

    @classmethod
    def from_cli(cls, text: str) -> SpeculativeConfig:
        """The `--speculative-config` flag's value: a JSON object."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def resolve(self, num_nextn_predict_layers: int = 0) -> int:
        """The number of draft tokens per step, once the target's config is known.

        mtp needs the target's `num_nextn_predict_layers` (or a head file as `model`); more
        drafts than layers reapply them, so k must then be a multiple of the layer count.
        """
        n = num_nextn_predict_layers
        if self.method == "mtp" and self.model is None:
            if n < 1:
                raise ValueError(
                    "method 'mtp' needs a model with num_nextn_predict_layers >= 1, "
                    "or an MTP head file as 'model'"
                )
            k = self.num_speculative_tokens or n
            if k > n and k % n:
                raise ValueError(
                    f"num_speculative_tokens ({k}) must be a multiple of "
                    f"num_nextn_predict_layers ({n}) when it exceeds it"
                )
            self.num_speculative_tokens = k
        elif self.num_speculative_tokens is None:  # mtp with a head file: one layer by default
            self.num_speculative_tokens = 1
        return self.num_speculative_tokens

    def use_speculation(self, num_running: int) -> bool:
        """False once the batch reaches disable_by_batch_size: a full batch drafts nothing."""
        limit = self.disable_by_batch_size
        return limit is None or num_running < limit

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _infer_method(model: Any) -> str:
    """vLLM's guess when `method` is absent: the model name decides."""
    if model is None:
        raise ValueError("speculative config needs 'method' (or a 'model' to infer it from)")
    name = str(model).lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    if "eagle3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"


def _check_types(cfg: SpeculativeConfig) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and "None" in str(f.type):
            continue
        want = str(f.type).split(" | ")[0]
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
        }[want]
        if not ok:
            raise ValueError(f"{f.name} must be {want}, got {value!r}")
