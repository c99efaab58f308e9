"""kvmesh engine."""
