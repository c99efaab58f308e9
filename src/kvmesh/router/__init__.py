"""kvmesh router: cache-aware scheduling in front of vLLM-compatible engines."""
