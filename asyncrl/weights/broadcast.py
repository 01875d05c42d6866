"""Weight sync by broadcast over a torch.distributed group made for it alone (DESIGN §7).

The group is never the trainer's default group and is built without `init_process_group`: the
publisher (trainer rank 0, always rank 0 here) runs a TCPStore server, and for each membership it
forms a group `new_group(PrefixStore(f"wsync/{epoch}", store), rank, size, timeout)`. A group
lives for an epoch — as many versions as its membership stays the same, which keeps NCCL/HCCL
communicators alive across versions (rebuilding HCCL ones at every sync exhausts Ascend driver
resources). Membership changes only at a version boundary: joins, leases that lapsed, a member
that reported a failed receive, or a failed send all make the next version go to a new epoch.

Rendezvous: fields of the run's `weights` hash (`Keys.weights`); every write is followed by a
PUBLISH on the channel of the same name (the doorbell subscribers block on).

    transport      "broadcast"
    backend        gloo | nccl | hccl, the publisher's; subscribers check theirs against it
    master         "host:port" of the publisher's TCPStore
    proposal       {"epoch": e, "candidates": [worker ids]}: epoch e is forming
    ready:{id}     the epoch subscriber {id} is ready to join (deleted after a failed receive,
                   and by a new subscriber under that id)
    epoch          the formed epoch ...
    members        ... and its members, JSON list; a member's rank is its index + 1
    send           {"epoch": e, "seq": n, "version": v}: the n-th send of epoch e starts now
    sent_version   last version delivered to every member
    join:{id}      subscriber {id} wants weights (JSON: host, pid, incarnation — random per
                   subscriber —, and the floating `dtype` its engine keeps if it said); it counts
                   as live while the key `{Keys.weights}:lease:{id}` exists (TTL lease_s,
                   refreshed every lease_s/3)
    delta          "1" while versions may go as deltas (`weights.delta`): subscribers keep a
                   copy of what they hold to apply them to
    delta_dir      `weights.delta.pull_dir`: where a subscriber pulls the versions it lacks
    behind:{id}    a version subscriber {id} could neither apply nor pull: the publisher sends
                   it again in full, to the group as it is (deleted once sent)

Forming epoch e: the publisher proposes it to the live subscribers, waits until each has set
`ready:{id}` = e (a candidate whose lease lapses, or the sync timeout, ends the wait), writes
`epoch` and `members` = those ready, and all of them build the group. A subscriber that was left
out stays registered and is proposed again at the next boundary — or at once, once it answers
late (a newcomer slower to start than the sync timeout says ready for the epoch it first sees).
Building goes through a gate in the TCPStore (prefix `wsync/{e}`): each member sets
`arrived/{rank}` and waits for `go`, which the publisher sets to 1 once all have arrived, or to 0
as soon as a missing member's lease lapses. A member that dies after saying ready then costs its
lease (`weights.lease_s`), not the sync timeout that the collective's own rendezvous would wait
out, for everyone.

A worker restarted under its old id is a new subscriber: it registers with a new `join:` record
and clears the `ready:` its predecessor may have left, and it takes no part in an epoch formed
before it first saw the publisher. The publisher, seeing a record that differs from the one it
last saw under that id, forgets what the predecessor held or failed to answer, so the newcomer
gets the current version at once rather than at the next publish (which, with one worker, never
comes). If Redis loses the hash (restarted empty), the publisher writes its rendezvous fields
again at its next look at the hash, so that workers can still find it.

One version on the wire (`buckets.Header`): a header (version, sizes), the layout (JSON), the flat
buffer in buckets, and a trailer holding the checksum, all posted without waiting so that they
pipeline; a deferred copy is packed bucket by bucket just before each is posted. A
delta (`asyncrl.weights.delta`; header `base` ≥ 0) sends its table and its payload in buckets
instead of the flat buffer, and the checksum of the buffer it produces; a member that lacks its
base pulls the versions from `delta_dir` or asks for an anchor (`behind:`), never leaving the group
for it. Subscribers enter the collectives only once a send is announced, so none ever waits inside
one between versions (an NCCL kernel would occupy its GPU meanwhile); they take part in every
announced send of their epoch, in order. A failed op aborts the group: the publisher's failure
makes it resend to a rebuilt group (at once if nothing newer is staged), a subscriber's — e.g. the
peer it relays to in gloo's broadcast tree died — is reported by deleting its `ready:` field.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import redis
import torch
import torch.distributed as dist

from asyncrl.device import synchronize
from asyncrl.weights.base import (
    POLL_S,
    BackgroundPublisher,
    BackgroundSubscriber,
    Released,
    SyncRecord,
    announce,
    dtype_name,
    floating_dtype,
    read_hash,
)
from asyncrl.weights.buckets import (
    FlatBuffer,
    Header,
    Layout,
    bucket_ranges,
    checksum,
    wrap64,
)
from asyncrl.weights.config import BroadcastWeightsConfig
from asyncrl.weights.delta import BUCKET_BYTES, Delta, DeltaRefused, DeltaSource, Held, word_dtype
from asyncrl.weights.groups import (
    Group,
    broadcast_all,
    comm_device,
    local_addr_towards,
    master_store,
    new_group,
    post_broadcasts,
    release_group,
    resolve_backend,
)
from asyncrl.weights.members import Lease, join_record, leased, live_joins
from asyncrl.weights.versions import DeltaLog, read_to

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.runstate import Keys

log = logging.getLogger(__name__)

_READY_POLL_S = 0.01
_MAX_FAILURES = 3  # failed deliveries of one version; then it waits for the next publish


class BroadcastPublisher(BackgroundPublisher):
    def __init__(
        self,
        cfg: BroadcastWeightsConfig,
        client: redis.Redis,
        keys: Keys,
        device: torch.device,
        on_record: Callable[[SyncRecord], None] | None,
    ) -> None:
        self._backend = resolve_backend(cfg.backend, device)
        self._device = comm_device(self._backend, device)
        super().__init__(self._device, on_record, close_timeout_s=3 * cfg.sync_timeout_s)
        self._client, self._keys = client, keys
        self._bucket_bytes = cfg.bucket_mb << 20
        self._streams_copy = True
        self._timeout = timedelta(seconds=cfg.sync_timeout_s)
        self._addr = cfg.master_addr
        self._store = master_store(cfg.master_addr, cfg.master_port, self._timeout)
        self._rendezvous = {
            "transport": "broadcast",
            "backend": self._backend,
            "master": f"{cfg.master_addr}:{self._store.port}",
            "delta": str(int(cfg.delta.enabled)),
        }
        if cfg.delta.enabled and cfg.delta.pull_dir is not None:
            self._rendezvous["delta_dir"] = str(cfg.delta.pull_dir)
        self._group: Group | None = None
        self._broken = False  # the group's last op failed
        self._members: list[str] = []
        self._seq = 0
        self._holders: set[str] = set()  # subscribers that received `_holders_version`
        self._holders_version: int | None = None
        self._unresponsive: set[str] = set()  # live, proposed, never ready: not worth a resend
        self._failures = 0  # failed deliveries of `_holders_version`
        self._joins: dict[str, str] = {}  # the `join:` record last seen of each live subscriber
        self._delta = DeltaSource(cfg.delta)
        self._based: set[str] = set()  # subscribers that hold the delta source's base
        pull = cfg.delta.pull_dir if cfg.delta.enabled else None
        self._pull = None if pull is None else DeltaLog(pull, 2, cfg.delta.anchor_every)
        h = read_hash(client, keys.weights)
        # Epochs keep counting across trainer restarts, so that no subscriber mistakes a new
        # epoch for one it was in; what a previous publisher left mid-way is cleared.
        proposal = json.loads(h.get("proposal", '{"epoch": -1}'))
        self._epoch = max(int(h.get("epoch", -1)), proposal["epoch"])
        client.hdel(keys.weights, "proposal", "members", "send")
        announce(client, keys, **self._rendezvous)
        self._start()

    def _live(self) -> tuple[list[str], dict[str, str]]:
        """Registered subscribers whose lease holds (sorted), and the hash they were read from.

        Registrations whose lease lapsed are removed on the way. A subscriber whose record is
        new, or differs from the one last seen under its id (a worker restarted with its id),
        starts afresh: what its predecessor held or left unanswered says nothing about it. A hash
        without the rendezvous fields (Redis restarted empty) gets them again.
        """
        joins, h = live_joins(self._client, self._keys)
        if "master" not in h:
            log.warning("weights: the rendezvous fields are gone from Redis; writing them again")
            announce(self._client, self._keys, **self._rendezvous)
        live = list(joins)
        renewed = {w for w in live if self._joins.get(w) != joins[w]}
        if renewed:
            self._holders -= renewed
            self._based -= renewed
            self._unresponsive -= renewed
            self._failures = 0  # a newcomer deserves its tries, even of a version that failed
        self._joins = {w: joins[w] for w in live}
        declared = {floating_dtype(join_record(joins[w]).get("dtype")) for w in live}
        self._narrow_to = declared.pop() if len(declared) == 1 else None
        return live, h

    def _stale(self, live: list[str], h: dict[str, str]) -> bool:
        return (
            self._broken
            or set(live) != set(self._members)
            or any(h.get(f"ready:{m}") != str(self._epoch) for m in self._members)
        )

    def _wants_resend(self) -> bool:
        live, h = self._live()  # first: it may reset the failures, for a newcomer
        if self._failures >= _MAX_FAILURES:
            return False
        # One that answered after its epoch was formed without it (a newcomer slower to start
        # than the sync timeout) is here after all: without a new epoch now, it would wait for
        # the next publish, which with one worker never comes.
        self._unresponsive -= {
            w for w in self._unresponsive if h.get(f"ready:{w}") == str(self._epoch)
        }
        # A member that withdrew its readiness failed to receive, even if the send succeeded
        # here (in gloo's tree it may relay for a peer that died).
        withdrawn = {m for m in self._members if h.get(f"ready:{m}") != str(self._epoch)}
        self._holders -= withdrawn
        self._based -= withdrawn
        # A member that refused a delta and could not pull what it lacks waits for an anchor.
        return bool(set(live) - self._holders - self._unresponsive) or bool(self._behind(h))

    def _behind(self, h: dict[str, str]) -> list[str]:
        return [m for m in self._members if f"behind:{m}" in h]

    def _await_ready(self, epoch: int, candidates: list[str]) -> list[str]:
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            h = read_hash(self._client, self._keys.weights)
            ready = [c for c in candidates if h.get(f"ready:{c}") == str(epoch)]
            pending = [c for c in candidates if c not in ready]
            if not pending or time.monotonic() > deadline:
                return ready
            if not any(leased(self._client, self._keys, pending)):
                return ready  # only subscribers whose lease lapsed are missing: they are gone
            time.sleep(_READY_POLL_S)

    def _form(self, candidates: list[str]) -> None:
        self._release()
        self._epoch += 1
        epoch = self._epoch
        announce(
            self._client,
            self._keys,
            proposal=json.dumps({"epoch": epoch, "candidates": candidates}),
        )
        members = self._await_ready(epoch, candidates)
        self._unresponsive = set(candidates) - set(members)
        if self._unresponsive:
            log.warning("weights epoch %d: no answer from %s", epoch, sorted(self._unresponsive))
        self._members, self._seq = members, 0
        announce(self._client, self._keys, epoch=str(epoch), members=json.dumps(members))
        self._group_formed()
        log.info("weights epoch %d: %d subscriber(s)", epoch, len(members))
        if members:
            store = dist.PrefixStore(f"wsync/{epoch}", self._store)
            gone = self._await_arrival(store, members)
            store.set("go", "0" if gone else "1")
            if gone:
                raise RuntimeError(f"weights epoch {epoch}: {gone} left before the group was built")
            self._group = new_group(
                self._backend, store, 0, len(members) + 1, self._timeout, self._device, self._addr
            )
        self._broken = False

    def _await_arrival(self, store: dist.Store, members: list[str]) -> list[str]:
        """Wait until every member has arrived at the gate; the members whose lease lapsed
        first (or that the sync timeout gave up on)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            missing = [m for i, m in enumerate(members, 1) if not store.check([f"arrived/{i}"])]
            if not missing:
                return []
            if time.monotonic() > deadline:
                return missing
            alive = leased(self._client, self._keys, missing)
            gone = [m for m, a in zip(missing, alive, strict=True) if not a]
            if gone:
                return gone
            time.sleep(_READY_POLL_S)

    def _release(self) -> None:
        if self._group is not None:
            release_group(self._group, broken=self._broken)
            self._group = None

    def _send(self, buffer: FlatBuffer, version: int) -> tuple[int, int | None]:
        if version != self._holders_version:
            self._holders, self._holders_version, self._failures = set(), version, 0
        delta, behind = None, []
        try:
            live, h = self._live()
            if self._stale(live, h):
                # Forming waits for the members (as long as the sync timeout): the trainer,
                # waiting in `copied()`, must not wait with it.
                self._packed_through(buffer.layout.total_bytes)
                self._form(live)
            if self._group is not None:
                behind = self._behind(h)
                if self._delta.enabled:  # a delta is encoded from the whole buffer
                    self._packed_through(buffer.layout.total_bytes)
                # Without a directory to pull from, a member that lacks the base needs the
                # version in full; with one it pulls, and the others keep getting deltas.
                lacking = self._pull is None and bool(set(self._members) - self._based)
                delta = self._delta.encode(
                    buffer.flat, buffer.layout, version, anchor=bool(behind) or lacking
                )
                if self._pull is not None:  # before the send: a refusing member reads it
                    self._pull.write(buffer, version, delta)
                self._broadcast(buffer, version, delta)
        except RuntimeError:  # c10d errors (DistError and kin) all derive from it
            self._broken = True
            self._failures += 1
            raise
        self._holders |= set(self._members)
        self._failures = 0
        if self._members and self._delta.enabled:
            self._delta.sent(buffer.flat, buffer.layout, version, delta)
            self._based = set(self._members)
        pipe = self._client.pipeline(transaction=True)
        if delta is None and behind:
            pipe.hdel(self._keys.weights, *(f"behind:{m}" for m in behind))
        pipe.hset(self._keys.weights, "sent_version", str(version))
        pipe.publish(self._keys.weights, "sent_version")
        pipe.execute()
        if not self._members:
            return 0, 0
        self._sent_delta = delta is not None
        sent = buffer.layout.total_bytes if delta is None else delta.nbytes
        return sent, len(self._members)

    def _broadcast(self, buffer: FlatBuffer, version: int, delta: Delta | None) -> None:
        assert self._group is not None
        layout = buffer.layout.to_bytes()
        total = buffer.layout.total_bytes
        if delta is None:
            header = Header(version, total, self._bucket_bytes, len(layout))
            body, table = buffer.flat, []
        else:
            header = Header(
                version, total, self._bucket_bytes, len(layout), delta.base, delta.payload.numel()
            )
            body, table = delta.payload, [delta.table.to(self._device)]
        self._seq += 1
        send = {"epoch": self._epoch, "seq": self._seq, "version": version}
        announce(self._client, self._keys, send=json.dumps(send))
        head = [header.to_tensor(self._device)]
        head.append(torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(self._device))
        works = post_broadcasts(self._group, [*head, *table])
        # Bucket k goes on the wire as soon as it is packed, while bucket k+1 is; each is
        # summed once posted, so the checksum costs no pass of its own after the last one.
        sums = []
        for s, e in bucket_ranges(body.numel(), self._bucket_bytes):
            if delta is None:
                self._packed_through(e)
            works += post_broadcasts(self._group, [body[s:e]])
            if delta is None:
                sums.append(checksum(body[s:e]))
        check = wrap64(sum(sums)) if delta is None else delta.checksum
        trailer = torch.tensor([check], dtype=torch.int64, device=self._device)
        works += post_broadcasts(self._group, [trailer])
        for work in works:
            work.wait()
        # On an accelerator wait() only orders streams: the buffer is free for reuse (and the
        # send timed) once the device has finished.
        synchronize(self._device)

    def _shutdown(self) -> None:
        self._release()


class _ReceiveBuffers:
    """Flat receive buffers, reused once the engine has let go of what it was handed.

    A fresh buffer per version would be simplest, but on CPU its first-touch page faults land
    inside the collective and halve its speed (100 MB to 2 peers: 0.12 s → 0.25 s). The engine
    may keep the tensors it is handed (a zero-copy swap), so a buffer is reused only when no
    tensor outside this class shares its storage. Two are kept: the engine's live weights and
    the next version.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: list[torch.Tensor] = []

    @staticmethod
    def _free(buffer: torch.Tensor) -> bool:
        # No public API counts a storage's owners; inductor's cudagraph trees use this one.
        # Owners while free: `buffer` and the temporary storage object of the probe.
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2

    def take(self, nbytes: int) -> torch.Tensor:
        for buffer in self._buffers:
            if buffer.numel() == nbytes and self._free(buffer):
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        # One of another size (the layout changed: a narrower dtype) is never taken again.
        self._buffers = [buffer, *(b for b in self._buffers if b.numel() == nbytes)][:2]
        return buffer


class BroadcastSubscriber(BackgroundSubscriber[BroadcastWeightsConfig]):
    def _setup(self, cfg: BroadcastWeightsConfig) -> None:
        self._backend = resolve_backend(cfg.backend, self._device)
        self._comm = comm_device(self._backend, self._device)
        self._timeout = timedelta(seconds=cfg.sync_timeout_s)
        self._buffers = _ReceiveBuffers(self._comm)
        self._master: str | None = None
        self._store: dist.TCPStore | None = None
        self._group: Group | None = None
        self._epoch = -1  # the last epoch whose group this subscriber built, or formed unseen
        self._acked = -1  # the last epoch it declared itself ready for
        self._seq = 0  # sends of `_epoch` taken part in
        self._held = Held()  # a copy of the version handed over, while the publisher sends deltas
        self._delta_on = False
        self._pull_dir: Path | None = None
        keeps = {} if self._keeps_dtype is None else {"dtype": dtype_name(self._keeps_dtype)}
        self._lease = Lease(self._client, self._keys, self._id, cfg.lease_s, keeps)

    def close(self) -> None:
        self._lease.end()  # before the loop ends
        super().close()

    def _leave(self) -> None:
        self._drop_group(broken=False)
        self._doorbell.close()

    def _step(self) -> None:
        self._doorbell.wait(POLL_S)
        h = read_hash(self._client, self._keys.weights)
        master = h.get("master")
        if h.get("transport") != "broadcast" or master is None:
            return
        if master != self._master:
            self._drop_group(broken=True)
            self._master, self._store = master, None
            # Epochs formed so far were formed without this process, even one that lists its id
            # (a predecessor's, a worker restarted with its id): joining it would hang.
            self._epoch = self._acked = int(h.get("epoch", -1))
            if h.get("backend") != self._backend:
                log.error(
                    "weights: the publisher uses %s, this worker %s; not joining",
                    h.get("backend"),
                    self._backend,
                )
            elif self._epoch >= 0 and self._id not in json.loads(h.get("members", "[]")):
                # The epoch may have been proposed to this process before it looked, and formed
                # without it: a late answer makes the publisher propose the next one to it.
                self._client.hset(self._keys.weights, f"ready:{self._id}", str(self._epoch))
        if h.get("backend") != self._backend:
            return
        self._delta_on = h.get("delta") == "1"
        self._pull_dir = Path(h["delta_dir"]) if "delta_dir" in h else None
        self._take_sends(h)
        self._follow_epoch(h)

    def _take_sends(self, h: dict[str, str]) -> None:
        """Take part in every send announced in our epoch that we have not taken part in yet."""
        send = json.loads(h.get("send", "null"))
        while (
            send is not None
            and self._group is not None
            and send["epoch"] == self._epoch
            and send["seq"] > self._seq
        ):
            self._seq += 1
            self._receive(self._group)

    def _follow_epoch(self, h: dict[str, str]) -> None:
        proposal = json.loads(h.get("proposal", "null"))
        if proposal is not None and proposal["epoch"] > self._epoch:
            self._drop_group(broken=False)  # superseded; all its sends were taken above
            if self._id in proposal["candidates"] and proposal["epoch"] > self._acked:
                self._client.hset(self._keys.weights, f"ready:{self._id}", str(proposal["epoch"]))
                self._acked = proposal["epoch"]
        epoch = int(h.get("epoch", -1))
        members = json.loads(h.get("members", "[]"))
        if epoch > self._epoch and epoch == self._acked and self._id in members:
            self._epoch, self._seq = epoch, 0
            self._join(epoch, members.index(self._id) + 1, len(members) + 1)

    def _join(self, epoch: int, rank: int, size: int) -> None:
        assert self._master is not None
        try:
            host, port = self._master.rsplit(":", 1)
            if self._store is None:
                self._store = dist.TCPStore(
                    host, int(port), is_master=False, timeout=self._timeout, use_libuv=True
                )
            store = dist.PrefixStore(f"wsync/{epoch}", self._store)
            store.set(f"arrived/{rank}", "1")
            store.wait(["go"], self._timeout)
            if store.get("go") != b"1":
                raise RuntimeError("the publisher called the epoch off: a member left")
            listen = local_addr_towards(host, int(port))
            self._group = new_group(
                self._backend, store, rank, size, self._timeout, self._comm, listen
            )
        except RuntimeError as exc:
            log.warning("weights epoch %d: could not join: %s", epoch, exc)
            self._store = None  # the master may have restarted on the same address
            self._client.hdel(self._keys.weights, f"ready:{self._id}")

    def _receive(self, group: Group) -> None:
        try:
            header_t = Header.empty(self._comm)
            broadcast_all(group, [header_t])
            header = Header.from_tensor(header_t.cpu())
            layout_t = torch.empty(header.layout_bytes, dtype=torch.uint8, device=self._comm)
            broadcast_all(group, [layout_t])
            layout = Layout.from_bytes(layout_t.cpu().numpy().tobytes())
            if layout.total_bytes != header.total_bytes:
                raise ValueError("layout and header disagree on the size")
            if header.base >= 0:
                delta = self._receive_delta(group, header, layout)
            else:
                flat = self._receive_full(group, header)
        except (RuntimeError, ValueError) as exc:
            # Withdrawing readiness reports it: the publisher rebuilds and resends.
            log.warning("weights epoch %d: receive failed: %s", self._epoch, exc)
            self._drop_group(broken=True)
            self._client.hdel(self._keys.weights, f"ready:{self._id}")
            return
        if self._version is not None and header.version <= self._version:
            return  # a resend for a newcomer; this worker holds it already
        if header.base < 0:
            if self._delta_on:
                self._held.anchor(flat, layout, header.version)
            self._hand_over(Released(layout.views(flat.to(self._device))), header.version)
            return
        try:
            applied: torch.Tensor | None = self._held.apply(delta, layout)
        except DeltaRefused as exc:
            applied = self._pull(header.version, exc)
        if applied is not None:
            self._hand_over(Released(layout.views(applied.to(self._device))), header.version)

    def _receive_full(self, group: Group, header: Header) -> torch.Tensor:
        flat = self._buffers.take(header.total_bytes)
        ranges = bucket_ranges(header.total_bytes, header.bucket_bytes)
        trailer = torch.zeros(1, dtype=torch.int64, device=self._comm)
        buckets = [flat[s:e] for s, e in ranges]
        works = post_broadcasts(group, [*buckets, trailer])
        # Each bucket is summed once it is in, while the next ones are still arriving: the
        # check then costs one bucket's pass after the last byte, not the whole buffer's.
        sums = []
        for work, bucket in zip(works, buckets, strict=False):
            work.wait()
            sums.append(bucket.view(torch.int64).sum())
        works[-1].wait()
        if wrap64(sum(int(x) for x in sums)) != trailer.item():
            raise ValueError(f"version {header.version}: checksum mismatch")
        return flat

    def _receive_delta(self, group: Group, header: Header, layout: Layout) -> Delta:
        """Receive a delta whole; whether it applies to what is held is decided after."""
        n_buckets = len(bucket_ranges(header.total_bytes, BUCKET_BYTES))
        table = torch.empty(n_buckets, 3, dtype=torch.int64, device=self._comm)
        payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=self._comm)
        trailer = torch.zeros(1, dtype=torch.int64, device=self._comm)
        chunks = [payload[s:e] for s, e in bucket_ranges(payload.numel(), header.bucket_bytes)]
        broadcast_all(group, [table, *chunks, trailer])
        word = word_dtype(layout)
        return Delta(header.version, header.base, int(trailer.item()), word, table.cpu(), payload)

    def _pull(self, version: int, refused: DeltaRefused) -> torch.Tensor | None:
        """The flat buffer of `version` pulled from the publisher's directory; None (and an
        anchor asked for) where there is none to pull from, or it fails."""
        if self._pull_dir is not None:
            try:
                read_to(self._pull_dir, self._held, version, self._comm)
                assert self._held.flat is not None
                log.info(
                    "weights: version %d pulled from %s (%s)", version, self._pull_dir, refused
                )
                return self._held.flat.clone()
            except (OSError, ValueError) as exc:
                refused = DeltaRefused(f"{refused}; pulling it failed: {exc}")
        log.warning("weights: %s; asking for an anchor", refused)
        self._client.hset(self._keys.weights, f"behind:{self._id}", str(version))
        return None

    def _drop_group(self, *, broken: bool) -> None:
        if self._group is not None:
            release_group(self._group, broken=broken)
            self._group = None
