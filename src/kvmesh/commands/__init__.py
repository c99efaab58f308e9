"""The bodies of the `kvmesh` subcommands; `kvmesh.cli` builds the parser."""
