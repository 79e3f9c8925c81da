"""The device below everything: host <-> GPU copies that never wait for the GPU (``transfer``) and sizing the
caches from the device's memory (``memory``). Imports nothing from the engine; torch and the layers' shapes
only."""
