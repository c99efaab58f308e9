"""kvmesh bench."""
