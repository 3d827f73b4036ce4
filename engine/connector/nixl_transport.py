"""One NIXL agent per engine: registered regions, peers, READs and notifications.

The engine owns exactly one `NixlTransport`. It registers its memory regions (the KV cache,
recurrent-state snapshots), publishes `agent_metadata()` + `regions` through the handshake,
adds peers from their handshake documents, and READs units of a peer's regions into units
of its own. A READ carries a notification that NIXL delivers to the peer once the data has
landed, so the peer knows it may free what it held for us.

Threading: NOT thread-safe. The engine calls every method from one thread (its step loop);
NIXL's progress thread moves the bytes, sleeping on the UCX worker's events between them.
The handshake server never touches the agent: it serves a document built once from
`agent_metadata()` and `regions`.

Failures after validation (peer gone, transport error, timeout) never raise from
`start_read`/`poll`: the transfer ends FAILED with a reason, so the engine has one path for
"these units did not arrive". Input errors (unknown peer or region, ids out of range,
length mismatch) raise `RegionError`/`TransportError` before anything is issued.
"""

from __future__ import annotations

import enum
import ipaddress
import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from pdpool.engine.connector.regions import (
    RegionError,
    RegionLayout,
    check_read_pair,
    layout_of_tensors,
)

log = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """NIXL is unavailable, or a call names something the transport does not know."""


class TransferState(str, enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Notification:
    peer: str  # agent name of the sender
    message: bytes


@dataclass
class Transfer:
    id: int
    peer: str
    nbytes: int
    state: TransferState
    deadline: float | None
    error: str | None = None
    handle: Any = None  # NIXL xfer handle; None once released (or never created)


@dataclass
class _Peer:
    name: str
    regions: dict[str, RegionLayout]
    offsets: dict[str, int]  # first descriptor of each region in the peer's prepared list
    dlist: Any


def _load_nixl():
    try:
        from nixl import _api
    except ImportError as exc:  # the `nixl` extra is not installed
        raise TransportError(f"NIXL is not available ({exc}); install pdpool[nixl]") from None
    return _api


# The progress thread's longest sleep between wake-ups, in microseconds. It sleeps on the
# UCX worker's event file descriptor, so bytes still move as soon as they can; with NIXL's
# Python default of 0 it never sleeps and spins a core per agent even when idle.
PROGRESS_THREAD_DELAY_US = 10_000
_AGENT_LOCK = threading.Lock()


class _PacedBindings:
    """The NIXL bindings, except that agents get a progress thread that sleeps
    (`nixl_agent` sets `pthrDelay = 0` and offers no way to change it)."""

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return self._real.nixlAgent(name, config)


def _new_agent(api: Any, name: str, config: Any) -> Any:
    real = getattr(api, "nixlBind", None)
    if real is None or not hasattr(real.nixlAgentConfig(), "pthrDelay"):
        return api.nixl_agent(name, config)  # another NIXL layout: its own default
    with _AGENT_LOCK:
        api.nixlBind = _PacedBindings(real)
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = real


def keep_ucx_on_loopback(host: str | None) -> bool:
    """Before the first agent: when peers reach this engine at a loopback address
    (--kv-host 127.0.0.1, as `pdpool up` runs it), UCX's TCP listeners go on `lo` only
    (UCX_NET_DEVICES=lo); otherwise UCX opens one on every network device, where anyone
    who reaches the machine could connect and READ the registered KV memory. An explicit
    UCX_NET_DEVICES stands. A routable --kv-host keeps UCX's own choice: restricting the
    devices to that address's interface would also drop RDMA NICs (in a pod, UCX's TCP
    listeners are on the pod's own interface anyway). True when it pinned UCX to lo."""
    if not host or os.environ.get("UCX_NET_DEVICES"):
        return False
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        os.environ["UCX_NET_DEVICES"] = "lo"
    return loopback


def _name(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NixlTransport:
    """See the module docstring. Use as a context manager or call `close()`."""

    def __init__(
        self,
        engine_id: str,
        *,
        agent_name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        host: str | None = None,
    ):
        """`host`: where peers reach this engine (--kv-host): see keep_ucx_on_loopback."""
        api = _load_nixl()
        keep_ucx_on_loopback(host)
        self.engine_id = engine_id
        # A fresh name per process: a restarted engine must not be mistaken for its old self.
        self.agent_name = agent_name or f"{engine_id}-{uuid.uuid4().hex[:12]}"
        # The progress thread moves bytes while the engine computes (a peer reading from
        # us needs it over transports that emulate READ with messages).
        config = api.nixl_agent_config(backends=list(backends), num_threads=num_threads)
        self._agent = _new_agent(api, self.agent_name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportError(
                f"NIXL backends {missing} could not be created "
                f"(available plugins: {self._agent.get_plugin_list()})"
            )
        self._regions: dict[str, RegionLayout] = {}
        self._offsets: dict[str, int] = {}
        self._registrations: list[Any] = []
        self._tensors: list[Any] = []  # keep registered memory alive
        self._local_dlist: Any = None
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, Transfer] = {}
        self._unreleased: list[Transfer] = []  # handles NIXL refused to release (still active)
        self._ids = itertools.count(1)
        self._closed = False
        self.bytes_read = 0
        self.reads_done = 0
        self.reads_failed = 0

    # ---- local memory -------------------------------------------------------------------

    @property
    def regions(self) -> dict[str, RegionLayout]:
        return dict(self._regions)

    @property
    def mem_type(self) -> str | None:
        return next(iter(self._regions.values())).mem_type if self._regions else None

    def register_region(self, name: str, tensors: Any) -> RegionLayout:
        """Register a tensor (or tensors sharing a leading dim) as region `name`."""
        self._check_open()
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if name in self._regions:
            raise RegionError(f"region {name!r} is already registered")
        if self._transfers:
            # the local descriptor list is rebuilt below; live transfers still point at it
            raise TransportError("register every region before starting transfers")
        layout = layout_of_tensors(name, tensors)
        if self.mem_type not in (None, layout.mem_type):
            # One descriptor list per engine keeps a multi-region READ a single NIXL
            # transfer with a single notification; NIXL lists are single-memory-type.
            raise RegionError(
                f"region {name!r} is {layout.mem_type} but earlier regions are "
                f"{self.mem_type}; all regions of an engine share one memory type"
            )
        reg = self._agent.register_memory(
            [
                (a, layout.num_units * s, layout.device_id, "")
                for a, s in zip(layout.base_addrs, layout.slice_bytes, strict=True)
            ],
            layout.mem_type,
        )
        self._registrations.append(reg)
        self._tensors.extend(tensors)
        self._offsets[name] = sum(r.num_descriptors for r in self._regions.values())
        self._regions[name] = layout
        self._prepare_local_dlist()
        return layout

    def _prepare_local_dlist(self):
        if self._local_dlist is not None:
            self._agent.release_dlist_handle(self._local_dlist)
        descs = [d for r in self._regions.values() for d in r.descriptors()]
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self.mem_type)

    def agent_metadata(self) -> bytes:
        """What a peer needs (with `regions`) to read from this engine."""
        self._check_open()
        return self._agent.get_agent_metadata()

    # ---- peers --------------------------------------------------------------------------

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def peer_regions(self, peer: str) -> dict[str, RegionLayout]:
        return dict(self._require_peer(peer).regions)

    def add_peer(self, agent_metadata: bytes, regions: Mapping[str, RegionLayout]) -> str:
        """Load a peer's metadata and prepare its regions; returns the peer's agent name.

        Adding a known peer again is a no-op if its regions are unchanged (reads in flight
        go on); if they changed, it is replaced and its unfinished reads end FAILED.
        """
        self._check_open()
        regions = dict(regions)
        mem_type = self._check_peer_regions(regions)
        try:
            name = _name(self._agent.add_remote_agent(agent_metadata))
        except Exception as exc:
            raise TransportError(f"NIXL refused the peer metadata: {exc}") from None
        if name == self.agent_name:
            self._agent.remove_remote_agent(name)
            raise TransportError("a transport cannot add itself as a peer")
        known = self._peers.get(name)
        if known is not None and known.regions == regions:
            return name  # a repeated handshake: keep the peer and its reads in flight
        if known is not None:
            self._drop_peer(self._peers.pop(name), "peer re-registered", invalidate=False)
        offsets, descs, start = {}, [], 0
        for rname, remote in regions.items():
            offsets[rname] = start
            start += remote.num_descriptors
            descs.extend(remote.descriptors())
        dlist = None
        if descs:
            try:
                dlist = self._agent.prep_xfer_dlist(name, descs, mem_type)
            except Exception as exc:
                self._agent.remove_remote_agent(name)
                raise TransportError(
                    f"peer {name}: its regions do not match its metadata ({exc})"
                ) from None
        self._peers[name] = _Peer(name, regions, offsets, dlist)
        return name

    def _check_peer_regions(self, regions: Mapping[str, RegionLayout]) -> Optional[str]:
        """A peer's regions must share one memory type (returned; None without regions)
        and lay their units out as ours do."""
        mem_types = {r.mem_type for r in regions.values()}
        if len(mem_types) > 1:
            raise RegionError(f"peer regions mix memory types {sorted(mem_types)}")
        for name, remote in regions.items():
            local = self._regions.get(name)
            if local is not None and local.slice_bytes != remote.slice_bytes:
                raise RegionError(
                    f"region {name!r}: peer unit layout {list(remote.slice_bytes)}"
                    f" bytes differs from ours {list(local.slice_bytes)}"
                )
        return next(iter(mem_types), None)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its unfinished transfers end FAILED."""
        self._drop_peer(
            self._peers.pop(self._require_peer(peer).name), "peer removed", invalidate=True
        )

    def _drop_peer(self, peer: _Peer, reason: str, invalidate: bool):
        for t in list(self._transfers.values()):
            if t.peer == peer.name and t.state is TransferState.IN_PROGRESS:
                self._fail(t, reason)
            if t.peer == peer.name:
                self._release_handle(t)
        if peer.dlist is not None:
            _quietly(self._agent.release_dlist_handle, peer.dlist)
        if invalidate:
            _quietly(self._agent.remove_remote_agent, peer.name)

    def _require_peer(self, peer: str) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise TransportError(f"unknown peer {peer!r}") from None

    # ---- transfers ----------------------------------------------------------------------

    def start_read(
        self,
        peer: str,
        units: Mapping[str, tuple[Sequence[int], Sequence[int]]],
        notification: bytes | str = b"",
        timeout_s: float | None = None,
    ) -> int:
        """READ remote units into local units: `{region: (local_ids, remote_ids)}`.

        `notification` reaches the peer once all the bytes have landed (also when nothing is
        to be read). Returns a transfer id for `poll`/`release`.
        """
        self._check_open()
        p = self._require_peer(peer)
        if isinstance(notification, str):
            notification = notification.encode()
        local_idx: list[int] = []
        remote_idx: list[int] = []
        nbytes = 0
        for region, (local_ids, remote_ids) in units.items():
            local = self._regions.get(region)
            if local is None:
                raise RegionError(f"region {region!r} is not registered here")
            remote = p.regions.get(region)
            if remote is None:
                raise RegionError(f"peer {peer} has no region {region!r}")
            lids, rids = check_read_pair(local, remote, local_ids, remote_ids)
            local_idx += local.descriptor_indices(lids, self._offsets[region])
            remote_idx += remote.descriptor_indices(rids, p.offsets[region])
            nbytes += len(lids) * local.unit_bytes
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        t = Transfer(next(self._ids), p.name, nbytes, TransferState.IN_PROGRESS, deadline)
        self._transfers[t.id] = t
        try:
            if not local_idx:
                if notification:
                    self._agent.send_notif(p.name, notification)
                self._finish(t)
                return t.id
            t.handle = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, local_idx, p.dlist, remote_idx, notification
            )
            status = self._agent.transfer(t.handle)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError: the peer is gone
            self._fail(t, f"could not start: {exc}")
            return t.id
        self._advance(t, status)
        return t.id

    def poll(self, transfer_id: int) -> TransferState:
        """DONE, IN_PROGRESS or FAILED (see `transfer(transfer_id).error`)."""
        t = self.transfer(transfer_id)
        if t.state is TransferState.IN_PROGRESS:
            try:
                status = self._agent.check_xfer_state(t.handle)
            except Exception as exc:
                self._fail(t, str(exc))
            else:
                self._advance(t, status)
        if (
            t.state is TransferState.IN_PROGRESS
            and t.deadline is not None
            and time.monotonic() > t.deadline
        ):
            self._fail(t, "timed out")
            self._release_handle(t)  # cancels the READ in NIXL
        return t.state

    @property
    def transfer_ids(self) -> list[int]:
        """Transfers not yet released (finished or not)."""
        return list(self._transfers)

    def transfer(self, transfer_id: int) -> Transfer:
        try:
            return self._transfers[transfer_id]
        except KeyError:
            raise TransportError(f"unknown transfer {transfer_id}") from None

    def release(self, transfer_id: int) -> bool:
        """Forget a transfer and free its NIXL handle (cancelling it if still running).

        Returns False if NIXL could not cancel it: its local units may still be written, so
        the caller must not reuse them until a later `release` (or `pending_releases() == 0`).
        """
        t = self.transfer(transfer_id)
        if t.state is TransferState.IN_PROGRESS:
            self._fail(t, "released while in progress")
        released = self._release_handle(t)
        if released:
            del self._transfers[transfer_id]
        return released

    def pending_releases(self) -> int:
        """Handles NIXL refused to release; retried on every call of this method."""
        for t in list(self._unreleased):
            self._release_handle(t)
        return len(self._unreleased)

    def _advance(self, t: Transfer, status: str):
        if status == "DONE":
            self._finish(t)
        elif status != "PROC":
            self._fail(t, f"NIXL reported {status}")

    def _finish(self, t: Transfer):
        t.state = TransferState.DONE
        self.bytes_read += t.nbytes
        self.reads_done += 1

    def _fail(self, t: Transfer, reason: str):
        t.state, t.error = TransferState.FAILED, reason
        self.reads_failed += 1
        log.warning("KV read %d from %s failed: %s", t.id, t.peer, reason)

    def _release_handle(self, t: Transfer) -> bool:
        if t.handle is None:
            return True
        try:
            self._agent.release_xfer_handle(t.handle)
        except Exception as exc:
            log.warning("NIXL could not release transfer %d yet: %s", t.id, exc)
            if t not in self._unreleased:
                self._unreleased.append(t)
            return False
        t.handle = None
        if t in self._unreleased:
            self._unreleased.remove(t)
        return True

    # ---- notifications ------------------------------------------------------------------

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order per peer."""
        self._check_open()
        new = self._agent.get_new_notifs()
        return [Notification(_name(peer), bytes(msg)) for peer, msgs in new.items() for msg in msgs]

    # ---- lifetime -----------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise TransportError("the transport is closed")

    def close(self) -> None:
        """Cancel transfers, drop peers, deregister memory. Idempotent."""
        if self._closed:
            return
        for name in list(self._peers):
            self._drop_peer(self._peers.pop(name), "transport closed", invalidate=True)
        for t in list(self._transfers.values()):
            self._release_handle(t)
        self._transfers.clear()
        if self._local_dlist is not None:
            _quietly(self._agent.release_dlist_handle, self._local_dlist)
            self._local_dlist = None
        for reg in self._registrations:
            _quietly(self._agent.deregister_memory, reg)
        self._registrations.clear()
        self._tensors.clear()
        self._closed = True

    def __enter__(self) -> "NixlTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # teardown must go on; NIXL errors here are not actionable
        log.debug("ignored NIXL teardown error in %s: %s", getattr(fn, "__name__", fn), exc)
