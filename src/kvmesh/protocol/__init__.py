"""Wire formats shared by every kvmesh component; imports nothing else from kvmesh."""
