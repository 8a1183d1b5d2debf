"""Ray mode's weight sync: one component that moves each new policy version from the update ranks to the rollout
actors, with its transport behind it (`weaver.apply.weight_transport`, rollout.weight_transport):

- `group`: one broadcast group (`forge.weight_group`, gloo on CPU, NCCL on GPU) hosted by update rank 0; rollout
  actor i joins as rank 1 + i*TP (a vLLM engine: one rank per tensor-parallel worker);
- `ipc` (colocated): one group per update rank that shares its GPU with rollout actors, buckets passed as CUDA IPC
  handles (shared memory on the CPU).

Only the plan (names, shapes, bucket layout) crosses Ray, once per group; the object store never carries weights.
A sync is submitted as the receives on every rollout actor first, then the sends on the ranks, so no actor waits in
a collective behind a call that waits for another. On-policy `publish` waits for the sync; asynchronous GRPO
(`algo.max_staleness` > 0) `queue`s it behind the generate calls in flight on each rollout actor and `collect`s it
later. A queued receive starts only when its actor's generates are done, which can take longer than the group's
timeout: the senders wait for every receiver to say it is ready before the broadcast starts (`ready_timeout`, set by
`TrainerWorker.host_weight_group` from the run's mode), so no collective is ever open while a receiver is still
generating. A receiver that dies meanwhile is the driver's to see: its every wait also watches the queued calls
(`in_flight`), so `get` raises `WorkerLost` at once, which closes the actors and with them every group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from weaver.apply import WeightRoutes

Get = Callable[[list, str], list]  # results of refs for a stage, a dead actor named (`RayStages._get`)


@dataclass
class WeightSync:
    """The weight groups between `ranks` (update actors, rank order) and `rollouts` (rollout actors), routed by
    `routes`. `tp`: workers per engine (a vLLM engine's tensor-parallel size; 1 for hf)."""

    routes: WeightRoutes
    ranks: list
    rollouts: list
    get: Get
    tp: int = 1
    version: int = 0  # the version the rollout actors hold (or will, once the queued syncs land)
    load_seconds: float = 0.0  # the last finished sync's receive time on the slowest rollout actor
    _receives: list = field(default_factory=list)  # queued syncs' receives on the rollout actors
    _sends: list = field(default_factory=list)  # and their sends on the update ranks

    def start(self, places: dict[str, list[dict]]) -> None:
        """Each hosting update rank (rank 0 alone for the broadcast group; under ipc every rank that shares its GPU
        with rollout actors) opens a group on its node (`places`: each actor's `where`, its node's address); its
        rollout actors join it, the k-th as ranks 1 + k*TP onwards. Blocks until every member has joined."""
        backend = "ipc" if self.routes.transport == "ipc" else ""  # '': gloo on CPU, NCCL on CUDA
        groups, tp = self.routes.groups, self.tp
        addrs = {r: places["update"][r]["node_ip"] for r in groups}
        hosts = [self.ranks[r].call.remote("host_weight_group", addrs[r], 1 + tp * len(g), backend)
                 for r, g in groups.items()]  # fmt: skip
        hosted = dict(zip(groups, self.get(hosts, "update"), strict=True))  # rank -> (plan, port)
        ips, calls = [p["node_ip"] for p in places["rollout"]], []
        for r, members in groups.items():
            (plan, port), world = hosted[r], 1 + tp * len(members)
            calls.append(self.ranks[r].call.remote("connect_weight_group", addrs[r], port))
            calls += [self.rollouts[i].call.remote("join_weight_group", 1 + k * tp, world, addrs[r], port, plan,
                                                   ips[i], backend) for k, i in enumerate(members)]  # fmt: skip
        self.get(calls, "update")

    def submit(self, version: int) -> tuple[list, list]:
        """One sync of `version`: the receive on every rollout actor, then the send on every rank (under FSDP each
        rank gathers every parameter, so all take part); (receives, sends)."""
        receives = [a.call.remote("receive_weights", version) for a in self.rollouts]
        return receives, [a.call.remote("send_weights") for a in self.ranks]

    def publish(self, version: int) -> float:
        """Sync `version` now and wait for it (the queued syncs first); seconds from the call to the last load."""
        self.collect()
        t0 = time.perf_counter()
        receives, sends = self.submit(version)
        self.get(receives, "rollout")
        self.get(sends, "update")
        self.version = version
        return time.perf_counter() - t0

    def queue(self, version: int) -> None:
        """Sync `version` behind the generate calls in flight (asynchronous GRPO); `collect` checks it later."""
        receives, sends = self.submit(version)
        self._receives += receives
        self._sends += sends
        self.version = version

    def in_flight(self) -> dict:
        """The queued syncs' calls not collected yet -> their stage ('rollout' receives, 'update' sends), for the
        driver to watch while it waits on anything else (a dead receiver must not leave a send waiting unseen)."""
        return {**dict.fromkeys(self._receives, "rollout"), **dict.fromkeys(self._sends, "update")}

    def collect(self, wait: bool = True) -> None:
        """Check the queued syncs (re-raising a failed one): all of them, or with `wait=False` those done already."""
        if done := _done(self._receives, wait):
            self.load_seconds = max(self.get(done, "rollout"))
            self._receives = [ref for ref in self._receives if ref not in done]
        if sent := _done(self._sends, wait):
            self.get(sent, "update")
            self._sends = [ref for ref in self._sends if ref not in sent]


def _done(refs: list, wait: bool) -> list:
    """`refs`, or (not `wait`) those of them finished already."""
    if not refs or wait:
        return list(refs)
    return ray.wait(refs, num_returns=len(refs), timeout=0)[0]
