"""The leases this process holds, and the heartbeat that keeps them while the process lives.

On a network store a claim is a lease in the server's time: a fence token and
an end, ``lease`` seconds after its holder's last renewal. What keeps it is
the holder's *process*: a heartbeat renews every lease the process holds every
``lease / 3`` seconds in one round trip (a round trip still out then does not hold
up the next: see ``ROUNDS_OUT``), and ``close()`` releases them at once.
A process that is killed, frozen (SIGSTOP) or cut off stops renewing, so its
leases end within ``lease`` seconds of the last renewal, and a late save of its
is fenced.

The heartbeat runs in a thread of its own, on an event loop of its own, with a
connection of its own (the backend's :class:`Renewer`): a handler that blocks
the application's event loop (synchronous work in an ``async def``) does not
stop it, so an owner keeps its claims for as long as its process lives, and is
not run a second time on another host meanwhile. A blocked loop past half a
lease is logged as a warning while leases are held. What can still starve the
heartbeat is the GIL: blocking calls release it and running Python code hands
it over every few milliseconds (``sys.getswitchinterval()``), but one C call
that holds it for longer than a lease would stop this thread too, and the owner
then loses its claims as a frozen process does.

The thread renews while the loop that opened the store exists; once that loop
is closed nobody is left to report the leases, so they are released. Leases
have a kind: idempotency claims (``CLAIM``) and concurrency slots (``SLOT``),
renewed by the same heartbeat, in the same round trip, by a Renewer that knows
both kinds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from .base import Claim, Hit, Release, Save, Vacate

__all__ = [
    "CLAIM",
    "RENEWALS_PER_LEASE",
    "SLOT",
    "Heartbeat",
    "HeldLeases",
    "Lease",
    "Renewer",
    "confirm_late",
    "let_lapse",
]

#: The kind of an idempotency claim's lease.
CLAIM = "claim"
#: The kind of a concurrency slot's lease (one per slot key and request).
SLOT = "slot"
# Renewals per lease: a lease survives two renewals lost in a row.
RENEWALS_PER_LEASE = 3
# Renewal rounds out at once, at most. A round still out at the next beat (its connection
# stopped answering, or waits on a slow server) does not hold up the next one, which goes
# on a connection of its own: one stalled round trip would otherwise outlast the lease
# (a round may take its whole deadline, connect and round trip, 8 s by default).
ROUNDS_OUT = 2


class Lease(NamedTuple):
    """One lease this process holds: its kind, its key and the fence token it holds it by."""

    kind: str
    key: str
    token: int


class HeldLeases:
    """The leases this process holds, taken and ended on the event loop, renewed from the
    heartbeat's thread (hence the lock). A key may hold several leases of one kind."""

    __slots__ = ("_leases", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: set[Lease] = set()

    def hold(self, kind: str, key: str, token: int) -> None:
        with self._lock:
            self._leases.add(Lease(kind, key, token))

    def end(self, kind: str, key: str, token: int) -> None:
        """The lease ended here (saved, released, or given up): renew it no more."""
        with self._lock:
            self._leases.discard(Lease(kind, key, token))

    def lost(self, lease: Lease) -> bool:
        """A renewal found ``lease`` gone: forget it; False if it had ended here meanwhile."""
        with self._lock:
            if lease in self._leases:
                self._leases.remove(lease)
                return True
            return False

    def snapshot(self) -> list[Lease]:
        with self._lock:
            return list(self._leases)

    def take_all(self) -> list[Lease]:
        """Every lease held, forgotten here (they are being released)."""
        with self._lock:
            leases, self._leases = list(self._leases), set()
        return leases

    def of(self, kind: str) -> dict[str, int]:
        """Key -> token of the leases of ``kind`` (one per key, as claims are)."""
        with self._lock:
            return {lease.key: lease.token for lease in self._leases if lease.kind == kind}

    def __len__(self) -> int:
        return len(self._leases)


def let_lapse(held: HeldLeases, ops: Iterable[object]) -> None:
    """Renew no more the leases ``ops`` took or were ending: their batch failed (or their
    caller gave up on it), so nobody will end them, and each lapses within ``lease``.

    A failed transaction on SQLite ends its claims with it; this is the same for a lease
    store. Without it, an owner whose Save or Release failed kept its claim renewed for
    as long as its process lived (every retry on every host waited, then 409), and a
    failed Vacate kept its slot. A Save whose reply was lost but which committed loses
    nothing: its claim had ended with it."""
    for op in ops:
        if isinstance(op, (Claim, Save, Release)):
            if op.token:
                held.end(CLAIM, op.key, op.token)
        elif isinstance(op, (Hit, Vacate)) and op.token and op.slots:
            for key in op.slots:
                held.end(SLOT, key, op.token)


async def confirm_late(heartbeat: Heartbeat, ops: Sequence[object], sent: float) -> None:
    """Claims granted by a batch sent at ``sent`` (``loop.time()``) whose replies were read
    more than half a lease later: renewed now, before their owners run.

    The heartbeat renews only what is held, and a claim is held once its reply is read:
    an event loop blocked (or starved) while the reply waited could read it after its
    lease ended, and a duplicate on another host could have claimed the key meanwhile;
    both would run the handler. A late claim that cannot be renewed now (taken over, or
    the round failed) is given up, renewed no more, and answered as held elsewhere, so its
    caller looks again (within a lease, the most the given-up one can still hold).
    """
    if asyncio.get_running_loop().time() - sent <= heartbeat.lease / 2:
        return
    late = [op for op in ops if isinstance(op, Claim) and op.token]
    if not late:
        return
    renewed = await heartbeat.confirm([Lease(CLAIM, op.key, op.token) for op in late])
    for op, ok in zip(late, renewed, strict=True):
        if not ok:
            heartbeat.held.end(CLAIM, op.key, op.token)
            op.token, op.held, op.retry_after = 0, True, heartbeat.lease


class Renewer(Protocol):
    """A backend's side of the heartbeat, used on the heartbeat's own loop only (its
    connection is its own). Each call is one round trip, connecting first when it has
    no connection, and raises :class:`~porch.errors.StoreError` when it fails."""

    async def renew(self, leases: Sequence[Lease]) -> Sequence[bool]:
        """Extend each lease by the store's lease from now; False where it is not held by
        that token any more (taken over after it lapsed, or ended)."""
        ...

    async def release(self, leases: Sequence[Lease]) -> None:
        """End ``leases`` now, waking whoever waits for them elsewhere."""
        ...

    async def close(self) -> None:
        """Close the connection (bounded)."""
        ...


class Heartbeat:
    """Renews ``held`` every ``lease / 3`` s from a thread of its own; releases it on close.

    ``renewer`` makes the backend's Renewer, on the heartbeat's loop. ``deadline``
    bounds each of its calls (a connect and a round trip). Start it on the loop the
    store serves (:meth:`start`); :meth:`close` may run on any loop, also after that
    one stopped, and ends in bounded time.
    """

    def __init__(
        self,
        held: HeldLeases,
        *,
        lease: float,
        renewer: Callable[[], Renewer],
        deadline: float,
        name: str,
        logger: logging.Logger,
    ) -> None:
        self.held = held
        self.lease = lease
        self.period = lease / RENEWALS_PER_LEASE
        self.deadline = deadline
        self.name = name
        self.logger = logger
        self._make_renewer = renewer
        self._owner: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stopping = threading.Event()
        # Published by the thread (its loop, then the event that wakes it).
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failing = False
        self._pinged: float | None = None  # when a ping to the owner loop was sent, unanswered
        self._warned = False
        # The renewers made, and those not in use (the heartbeat's loop only): each in use
        # is a round still out (see ROUNDS_OUT) or a confirm.
        self._renewers: list[Renewer] = []
        self._idle: list[Renewer] = []

    def start(self) -> None:
        self._owner = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Release every lease held and stop the thread; on any loop, bounded."""
        if self._thread is None:
            return
        self._thread = None
        self._stopping.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: it has finished
                loop.call_soon_threadsafe(wake.set)
        within = 2 * self.deadline + 1.0  # a renewal in flight, then the release
        done, _ = await asyncio.wait({asyncio.wrap_future(self._finished)}, timeout=within)
        if not done:
            # A daemon thread: it ends with the process. Its leases lapse: forgotten here,
            # so a heartbeat of the store opened again never renews them.
            self.held.take_all()
            self.logger.warning(
                "porch: the lease heartbeat did not stop within %.1f s; left to finish", within
            )

    async def confirm(self, leases: list[Lease]) -> list[bool]:
        """From the store's loop: renew ``leases`` now, in one round trip on the heartbeat's
        loop and connection; False where not renewed (taken over, or the round failed)."""
        loop = self._loop
        if loop is None or self._thread is None:
            return [False] * len(leases)
        try:
            renewal = asyncio.run_coroutine_threadsafe(self._renew_now(leases), loop)
        except RuntimeError:  # its loop has closed
            return [False] * len(leases)
        try:
            async with asyncio.timeout(self.deadline + 1.0):
                return await asyncio.wrap_future(renewal)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if caller is not None and caller.cancelling():
                raise  # this caller was cancelled
            return [False] * len(leases)  # the heartbeat's loop ended under the renewal
        except Exception:  # StoreError, or its deadline
            return [False] * len(leases)

    async def _renew_now(self, leases: list[Lease]) -> list[bool]:
        with self._borrowed() as renewer:
            async with asyncio.timeout(self.deadline):
                return list(await renewer.renew(leases))

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[Renewer]:
        """A renewer not in use (the last back: the likeliest to answer), or a new one
        (each in use is a round still out, or a confirm); on the heartbeat's loop."""
        if not self._idle:
            self._renewers.append(self._make_renewer())
            self._idle.append(self._renewers[-1])
        renewer = self._idle.pop()
        try:
            yield renewer
        finally:
            self._idle.append(renewer)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        self._finished.set_running_or_notify_cancel()  # close() no longer cancels it
        try:
            with asyncio.Runner() as runner:
                runner.run(self._beat())
        except Exception:  # pragma: no cover - _beat catches what a store raises
            self.logger.exception("porch: the lease heartbeat failed")
        finally:
            self._finished.set_result(None)

    async def _beat(self) -> None:
        self._renewers, self._idle = [], []  # every one made (to close), those not in use
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        owner = self._owner
        out: set[asyncio.Task[None]] = set()

        async def renew(leases: list[Lease]) -> None:
            with self._borrowed() as renewer:
                await self._renew(renewer, leases)

        try:
            while not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.period):
                        await self._wake.wait()
                if self._stopping.is_set():
                    break
                if owner is None or owner.is_closed():
                    break  # nobody is left to report these leases: released below
                leases = self.held.snapshot()
                if leases and len(out) < ROUNDS_OUT:
                    self._check_owner(owner, len(leases))
                    # While the last round is still out, this one borrows a renewer
                    # of its own (a connection of its own).
                    task = asyncio.create_task(renew(leases))
                    out.add(task)
                    task.add_done_callback(out.discard)
            if out:
                await asyncio.wait(out)  # each within its deadline
            with self._borrowed() as renewer:  # a confirm may still have one out
                await self._release(renewer)
        finally:
            for task in out:
                task.cancel()
            try:
                async with asyncio.timeout(self.deadline):
                    await asyncio.gather(*(renewer.close() for renewer in self._renewers))
            except Exception as exc:
                self.logger.debug("porch: closing the heartbeat's connection: %r", exc)

    async def _renew(self, renewer: Renewer, leases: list[Lease]) -> None:
        try:
            async with asyncio.timeout(self.deadline):
                renewed = await renewer.renew(leases)
        except Exception as exc:  # StoreError, or its deadline
            if not self._failing:  # once per outage
                self.logger.warning(
                    "porch: renewing this process's leases failed (%s); retrying every %.2g s",
                    str(exc) or type(exc).__name__,
                    self.period,
                )
                self._failing = True
            return
        if self._failing:
            self.logger.info("porch: renewing this process's leases works again")
            self._failing = False
        lost = sum(
            1 for lease, ok in zip(leases, renewed, strict=True) if not ok and self.held.lost(lease)
        )
        if lost:
            # Lapsed (the process was frozen, or could not renew) and perhaps taken over:
            # the owner's save will be fenced.
            self.logger.info("porch: %d lease(s) of this process ended before renewal", lost)

    async def _release(self, renewer: Renewer) -> None:
        leases = self.held.take_all()
        if not leases:
            return
        try:
            async with asyncio.timeout(self.deadline):
                await renewer.release(leases)
        except Exception as exc:
            self.logger.warning(
                "porch: could not release this process's %d lease(s) (%s); they lapse",
                len(leases),
                str(exc) or type(exc).__name__,
            )

    # -- is the owner's loop blocked? -------------------------------------------------------

    def _check_owner(self, owner: asyncio.AbstractEventLoop, held: int) -> None:
        """Warn once when the store's loop has run nothing for half a lease (leases held)."""
        if not owner.is_running():  # stopped between two runs: not blocked
            self._pinged = None
            return
        now = time.monotonic()
        pinged = self._pinged
        if pinged is None:
            self._pinged = now
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                owner.call_soon_threadsafe(self._pong, now)
        elif now - pinged > self.lease / 2 and not self._warned:
            self._warned = True
            self.logger.warning(
                "porch: the event loop has run nothing for %.1f s (synchronous work in a"
                " coroutine?); this process's %d lease(s) are kept from the heartbeat thread",
                now - pinged,
                held,
            )

    def _pong(self, sent: float) -> None:
        """On the owner's loop: it runs."""
        if self._pinged == sent:
            self._pinged = None
        if self._warned:
            self._warned = False
            self.logger.info(
                "porch: the event loop runs again, after %.1f s", time.monotonic() - sent
            )
