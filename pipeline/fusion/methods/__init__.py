"""Fusion methods, one per file, registered by name (see base.py). `get_method(name, ratio, **knobs)`
builds one; the files are found by `discover()` (this package, then $KVF_METHOD_PATH)."""
from kvf.pipeline.fusion.methods.base import (METHODS, FusionMethod, build_method, check_method_name,  # noqa: F401
                                              default_settings, discover, get_method, knob, method_names, register)
