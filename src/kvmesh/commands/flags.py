"""Command-line flags generated from config dataclasses, named as vLLM names them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence

# field -> (its flag, the deprecated spellings still taken), where the flag is not the field's
# name: one name per concept across serve, router and up
Renamed = Mapping[str, tuple[str, Sequence[str]]]


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: it sets the same field and says on stderr, once per use,
    which flag replaces it. Hidden from --help (the canonical flag's help names it)."""

    def __init__(self, option_strings, dest, canonical: str = "", **kwargs) -> None:
        self.canonical = canonical
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated; use {self.canonical}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def flag_of(name: str, renamed: Renamed | None = None) -> str:
    """The flag that sets field `name` (--max-num-seqs for max_num_seqs unless renamed)."""
    if renamed and name in renamed:
        return renamed[name][0]
    return "--" + name.replace("_", "-")


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls, helps: dict[str, str], renamed: Renamed | None = None
) -> None:
    """One flag per config field, named as vLLM names it (--max-num-seqs for max_num_seqs), or
    as `renamed` says, with its old spellings as deprecated aliases."""
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name not in helps:
            continue
        flag = flag_of(f.name, renamed)
        old = tuple(renamed[f.name][1]) if renamed and f.name in renamed else ()
        default = getattr(defaults, f.name)
        text = helps[f.name] + (f" [default: {default}]" if default is not None else "")
        if old:
            text += f" (formerly {', '.join(old)})"
        if f.metadata.get("only_when_given"):  # absent from the namespace unless given
            default = argparse.SUPPRESS
        if isinstance(getattr(defaults, f.name), bool):
            assert not old, "a renamed boolean flag needs --no- aliases too"
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=text
            )
            continue
        annotation = str(f.type)  # a string under `from __future__ import annotations`
        kind = (
            int
            if annotation.startswith("int")
            else (float if annotation.startswith("float") else str)
        )
        metavar = flag[2:].upper().replace("-", "_")
        parser.add_argument(
            flag, type=kind, default=default, help=text, dest=f.name, metavar=metavar
        )
        if old:
            parser.add_argument(
                *old,
                type=kind,
                dest=f.name,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                action=DeprecatedAlias,
                canonical=flag,
                metavar=metavar,
            )


def add_listen_args(p: argparse.ArgumentParser) -> None:
    """--host and --port of a server command."""
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on [default: 127.0.0.1].")
    p.add_argument("--port", type=int, default=8000, help="HTTP port [default: 8000].")


def config_from_args(cls, args: argparse.Namespace):
    """The config of the flags parsed; a field whose flag was not given (only_when_given) keeps
    its default."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
