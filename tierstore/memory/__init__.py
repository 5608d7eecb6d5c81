"""Host memory that the engine and the sidecar both map: the shared-memory
``arena``, the ``slab`` allocator that carves it into slots, and ``memcopy``,
the streaming block copies (with the optional ``_fastcopy`` C loop).

Imported by both processes; no I/O beyond mapping the arena.
"""
