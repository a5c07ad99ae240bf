"""Fusing stored chunk KVs: the engine's one layer loop, the methods, KV sources, the loading controller. No files, no store."""
