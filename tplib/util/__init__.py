"""Utilities every layer may use: :mod:`~tplib.util.files` (result files written
atomically) and :mod:`~tplib.util.machine` (this machine's cores, shared by local
pipeline processes)."""
