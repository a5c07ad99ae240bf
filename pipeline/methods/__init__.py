"""Fusion methods, one per file, registered by name (see base.py). Importing this package
registers them all; `get_method(name, **knobs)` builds one."""
from kvf.pipeline.methods.base import METHODS, FusionMethod, build_method, get_method, register  # noqa: F401
from kvf.pipeline.methods import full, prefix, reuse, cacheblend  # noqa: F401,E402
from kvf.pipeline.methods import pcw, epic, fusionrag, prophetkv, cachefocus, cachecraft  # noqa: F401,E402
