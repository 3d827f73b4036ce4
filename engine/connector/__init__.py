"""KV transfer between engines: NIXL transport, handshake, peer allowlist.

Import the submodules directly; this package imports nothing heavy so that the pure parts
(allowlist, compatibility hash, handshake documents) work without torch or NIXL.
"""
