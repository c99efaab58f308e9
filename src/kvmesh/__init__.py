"""kvmesh: distributed LLM inference for agentic workloads."""

from kvmesh.native import install_finder

install_finder()  # compiled router modules load only while their source is unchanged
