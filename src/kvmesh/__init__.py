from kvmesh import _fresh

_fresh.install()
