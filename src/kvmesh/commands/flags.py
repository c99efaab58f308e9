"""Command-line flags generated from config dataclasses, named as vLLM names them."""

from __future__ import annotations

import argparse
import dataclasses


def add_dataclass_args(parser: argparse.ArgumentParser, cls, helps: dict[str, str]) -> None:
    """One flag per config field, named as vLLM names it (--max-num-seqs for max_num_seqs)."""
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name not in helps:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = helps[f.name] + (f" [default: {default}]" if default is not None else "")
        if f.metadata.get("only_when_given"):  # absent from the namespace unless given
            default = argparse.SUPPRESS
        if isinstance(getattr(defaults, f.name), bool):
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
        parser.add_argument(flag, type=kind, default=default, help=text)


def config_from_args(cls, args: argparse.Namespace):
    """The config of the flags parsed; a field whose flag was not given (only_when_given) keeps
    its default."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
