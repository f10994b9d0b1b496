"""Online training's data path: the target computes hidden states ahead of the draft, in memory.

    token batches ──▶ producer thread: target capture ──▶ bounded queue (--prefetch steps) ──▶ train loop
    (DataLoader)      (a CUDA stream of its own; vLLM's TP workers run in their own processes)

Every rank that runs the target itself is a *host* for itself. A target that spans GPUs (vllm with
--tp, hf with --device-map) runs once per node, in the node's local rank 0: that host captures the
states of every rank of its node, step by step, and sends each rank its micro-batches' states with
torch.distributed point-to-point ops (NCCL on GPU, gloo on CPU) on a group of their own, one step
ahead of use; the other ranks (*clients*) read their own token batches and receive the states.
Nothing reaches disk, and every rank trains on exactly the batches an offline run from a store of
the same samples reads, so the loss curve, resume and validation are the offline ones.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eyas.train import startup
from eyas.train.data import PackSchedule, iterate_batches
from eyas.utils.io import EyasError

# what torchrun tells its workers; the target's own worker processes must not join the trainers' world
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


@dataclass
class Layout:
    """Which rank runs the target for which ranks: `host` captures for `served` (empty on clients)."""

    rank: int
    host: int
    served: list[int]

    @property
    def is_host(self) -> bool:
        return self.rank == self.host

    @property
    def clients(self) -> list[int]:
        return [r for r in self.served if r != self.rank]


def node_layout(rank: int, world: int, spans_gpus: bool) -> Layout:
    """One target per rank, or (a target spanning GPUs under torchrun) one per node, in its local rank 0."""
    if not spans_gpus or world == 1:
        return Layout(rank, rank, [rank])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    host = rank - rank % per_node
    served = list(range(host, min(host + per_node, world))) if rank == host else []
    return Layout(rank, host, served)


def target_gpus(asked: list[int] | None, tp: int | None, trainers_per_node: int) -> list[int] | None:
    """The GPUs (indices of this node's visible ones) the target takes: --target-gpus, else the `tp` GPUs
    after the trainers' (torchrun gives local rank r GPU r; `tp` None: all of them), else, when the node
    has too few, the first `tp` ones, shared with the trainers."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    want = tp or max(1, count - trainers_per_node)
    gpus = list(asked) if asked else list(range(trainers_per_node, trainers_per_node + want))
    if not asked and gpus[-1] >= count:
        gpus = list(range(want))
    bad = [g for g in gpus if not 0 <= g < count]
    if bad or len(gpus) < want:
        raise EyasError(f"the target needs {want} GPU(s) but gets {gpus} of the {count} visible: fix --target-gpus, "
                        "lower --tp, or run on a node with more GPUs")
    return gpus


@contextlib.contextmanager
def target_environment(gpus: list[int] | None):
    """The environment the target's worker processes start in: only the target's GPUs visible, none
    of torchrun's variables (vLLM's workers build a process group of their own), spawned, not forked
    (a fork would inherit this process's trainer process group)."""
    saved = dict(os.environ)
    try:
        for k in TORCHRUN_VARS:
            os.environ.pop(k, None)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if gpus is not None:
            visible = saved.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[g] for g in gpus)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class StateSpec:
    """The shape and dtype of one token's states, which clients need before the first message."""

    aux_dim: int
    hidden: int
    dtype: torch.dtype

    @classmethod
    def probe(cls, engine: Any) -> StateSpec:
        cap = engine.capture_flat([torch.zeros(1, dtype=torch.long)])
        return cls(int(cap.aux.shape[1]), int(cap.final.shape[1]), cap.aux.dtype)


class TargetFeed:
    """Online states for the training loop (`batches`) and for validation (`fill`), from this rank's
    target (a host) or from its node's host (a client). `close()` stops the producer and waits for
    what is still on the wire; every rank sends and receives the same steps, so nothing hangs."""

    def __init__(self, engine: Any, layout: Layout, spec: StateSpec, device: torch.device,
                 group: Any = None, depth: int = 2) -> None:
        self.engine, self.layout, self.spec, self.group, self.depth = engine, layout, spec, group, depth
        self.device = device  # the trainer's device
        self.wire = device if group is not None and dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.lock = threading.Lock()  # one capture at a time: the producer's or a validation's
        edev = getattr(engine, "device", torch.device("cpu"))
        self.stream = torch.cuda.Stream(edev) if edev.type == "cuda" else None
        self.pin = device.type == "cuda" and edev.type == "cpu"
        self.inflight: list[tuple[Any, torch.Tensor]] = []  # point-to-point work (and its tensor) not waited for
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=depth)

    # -- capture ---------------------------------------------------------------------------------

    def capture(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """The batch with the target's states (on its own CUDA stream when the target is on a GPU; the
        event says when they are ready), pinned when they go from host memory to a GPU trainer."""
        from eyas.train.data import fill_states

        with self.lock:
            if self.stream is None:
                out, ready = fill_states(batch, self.engine), None
            else:
                with torch.cuda.stream(self.stream):
                    out = fill_states(batch, self.engine)
                ready = torch.cuda.Event()
                ready.record(self.stream)
        if self.pin:
            out = {**out, **{k: out[k].pin_memory() for k in ("aux_hidden", "final_hidden")}}
        return out, ready

    @staticmethod
    def settle(batch: dict[str, Any], ready: Any) -> dict[str, Any]:
        """Make this thread's stream wait for a capture made on the producer's stream (and keep the
        allocator off its tensors until this stream is done with them)."""
        if ready is not None:
            stream = torch.cuda.current_stream(batch["aux_hidden"].device)
            stream.wait_event(ready)
            for k in ("aux_hidden", "final_hidden"):
                batch[k].record_stream(stream)
        return batch

    # -- the wire --------------------------------------------------------------------------------

    def send(self, batch: dict[str, Any], dst: int) -> None:
        for k in ("aux_hidden", "final_hidden"):
            t = batch[k].to(self.wire).contiguous()
            self.inflight.append((dist.isend(t, dst, group=self.group), t))  # the tensor lives until sent

    def receive(self, batch: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """Post the receives of `batch`'s states; wait on the returned work before using them."""
        n, s = batch["input_ids"].shape[0], self.spec
        aux = torch.empty(n, s.aux_dim, dtype=s.dtype, device=self.wire)
        final = torch.empty(n, s.hidden, dtype=s.dtype, device=self.wire)
        works = [(dist.irecv(t, self.layout.host, group=self.group), t) for t in (aux, final)]
        return {**batch, "aux_hidden": aux, "final_hidden": final}, works

    # -- training batches ------------------------------------------------------------------------

    def batches(self, source: Any, plan: PackSchedule, start_epoch: int, start_step: int, steps: int,
                **loader: Any) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
        """(epoch, step in epoch, this rank's micro-batches with states) for the next `steps` optimizer
        steps; `loader` goes to eyas.train.data.iterate_batches (token ids only)."""
        if steps <= 0:
            return iter(())
        if not self.layout.is_host:
            tokens = iterate_batches(source, plan, self.layout.rank, start_epoch, start_step, states=False, **loader)
            return self._received(tokens, steps)
        served = self.layout.served
        if served != [self.layout.rank]:
            loader["embed_table"] = None  # the trainer looks its rows up; the host would do it for every rank
        view = NodeLayout(plan, served)
        tokens = iterate_batches(source, view, 0, start_epoch, start_step, states=False, **loader)
        self.thread = threading.Thread(target=self._produce, args=(tokens, steps), name="eyas-target", daemon=True)
        self.thread.start()
        return self._hosted(steps)

    def _produce(self, tokens: Iterator, steps: int) -> None:
        """The producer thread: capture every served rank's micro-batches, step after step."""
        try:
            for i, (epoch, step, micro) in enumerate(tokens):
                if i >= steps or self.stop.is_set():
                    break
                A = len(micro) // len(self.layout.served)
                per_rank = {r: [self.capture(b) for b in micro[j * A:(j + 1) * A]]
                            for j, r in enumerate(self.layout.served)}
                self._put((epoch, step, per_rank))
        except BaseException as e:  # noqa: BLE001 - handed to the training loop, which re-raises it
            self._put(e)

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                self.queue.put(item, timeout=0.5)
                return

    def _take(self) -> tuple[int, int, dict[int, list]]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _hosted(self, steps: int) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
        """The host's own micro-batches; each client's are sent one step ahead of use."""
        me = self.layout.rank
        nxt = self._take()
        self._send_step(nxt)
        for i in range(steps):
            epoch, step, per_rank = nxt
            if i + 1 < steps:
                nxt = self._take()
                self._send_step(nxt)
            yield epoch, step, [self.settle(b, ready) for b, ready in per_rank[me]]

    def _send_step(self, item: tuple[int, int, dict[int, list]]) -> None:
        """Send the clients their states of one step (they posted the receives a step earlier), and
        forget the sends that are done: host and clients step together, so about two steps are in flight."""
        for r in self.layout.clients:
            for b, ready in item[2][r]:
                self.send(self.settle(b, ready), r)
        self.inflight = [(w, t) for w, t in self.inflight if not w.is_completed()]

    def _received(self, tokens: Iterator, steps: int) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
        """A client's micro-batches: token ids read here, states received from the host, one step ahead."""

        def post() -> tuple[int, int, list[tuple[dict[str, Any], list[Any]]]]:
            epoch, step, micro = next(tokens)
            posted = [self.receive(b) for b in micro]
            self.inflight += [wt for _, works in posted for wt in works]
            return epoch, step, posted

        nxt = post()
        for i in range(steps):
            epoch, step, posted = nxt
            if i + 1 < steps:
                nxt = post()
            for _, works in posted:
                self.wait(works)
            self.inflight = [(w, t) for w, t in self.inflight if not w.is_completed()]
            yield epoch, step, [b for b, _ in posted]

    # -- validation and the end ------------------------------------------------------------------

    def fill(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One batch's states now (validation: every rank of the node calls this with the same batch)."""
        if not self.layout.is_host:
            out, works = self.receive(batch)
            self.wait(works)
            return out
        out = self.settle(*self.capture(batch))
        for r in self.layout.clients:
            self.send(out, r)
        self.wait(self.inflight)
        self.inflight = []
        return out

    @staticmethod
    def wait(works: list[tuple[Any, torch.Tensor]]) -> None:
        for w, _ in works:
            w.wait()

    def close(self) -> None:
        """Stop the producer and wait for every send and receive still on the wire."""
        self.stop.set()
        if self.thread is not None:
            while self.thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    self.queue.get(timeout=0.1)
            self.thread = None
        self.wait(self.inflight)
        self.inflight = []


class NodeLayout:
    """A plan's packs for several consecutive ranks at once, step by step ([rank a's micro-batches,
    rank a+1's, ...] per step): what a host captures for its node, read through `iterate_batches`."""

    def __init__(self, plan: PackSchedule, ranks: list[int]) -> None:
        self.plan, self.ranks = plan, ranks
        self.grad_accum = plan.grad_accum * len(ranks)
        self.world, self.budget = plan.world, plan.budget

    def packs(self, epoch: int) -> list:
        return self.plan.packs(epoch)

    def rank_packs(self, epoch: int, rank: int = 0) -> list:
        A = self.plan.grad_accum
        per_rank = [self.plan.rank_packs(epoch, r) for r in self.ranks]
        return [p[s * A + m] for s in range(len(per_rank[0]) // A) for p in per_rank for m in range(A)]


# ---------------------------------------------------------------------------------------------
# starting the target
# ---------------------------------------------------------------------------------------------


@dataclass
class OnlineTarget:
    """What online training knows of its target: the engine (on hosts), its head, layers and the feed."""

    name: str
    config: Any  # the transformers config (None on clients: read it from `name`)
    aux_layer_ids: list[int]
    head: Any  # TargetHead
    engine: Any
    feed: TargetFeed


def open_online_target(opts: Any, info: Any, lengths: Any, budget: int, engine: Any = None) -> OnlineTarget:
    """The target for `eyas train --online` (`opts`: TrainOptions): started here when this rank hosts it
    (`engine` given: already started), and the feed of its states. Collective under torchrun."""
    from eyas.assets import resolve_model

    spans = engine is None and (opts.engine == "vllm" or opts.device_map is not None)
    layout = node_layout(info.rank, info.world, spans)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
    model = resolve_model(opts.model) if engine is None else str(opts.model)
    if layout.is_host and engine is None:
        max_len = int(min(budget, max(lengths))) + 1  # samples are cut to the budget in a pack
        with startup.timed("target load"):
            engine = start_engine(opts, info, model, max_len, budget, per_node)
    served = spans and info.world > 1
    group = None
    if served:  # every rank: the spec, the layers and the head are rank 0's; the states travel on a group
        from eyas.engines.head import read_target_head
        from eyas.train import distributed as D

        facts = (StateSpec.probe(engine), list(engine.aux_layer_ids), getattr(engine, "model_name", model)) \
            if info.rank == 0 else None
        spec, aux_layer_ids, name = D.broadcast_object(facts)
        if engine is not None and list(engine.aux_layer_ids) != aux_layer_ids:
            raise EyasError(f"rank {info.rank}'s target captures layers {engine.aux_layer_ids}, rank 0's "
                            f"{aux_layer_ids}")
        group = dist.new_group(backend="nccl" if info.device.type == "cuda" else "gloo")
        head = read_target_head(Path(resolve_model(name)))
    else:
        spec, aux_layer_ids, head = StateSpec.probe(engine), list(engine.aux_layer_ids), engine.target_head()
        name = getattr(engine, "model_name", model)
    feed = TargetFeed(engine, layout, spec, info.device, group, opts.prefetch)
    config = getattr(engine, "config", None)  # hf: transformers' config; vllm keeps config.json as a dict
    return OnlineTarget(name, None if isinstance(config, dict) else config, aux_layer_ids, head, engine, feed)


def start_engine(opts: Any, info: Any, model: str, max_len: int, budget: int, trainers_per_node: int) -> Any:
    """The target engine on its GPUs: hf on this rank's GPU (or --target-gpus' first), spread over the
    target's GPUs with --device-map auto; vLLM's workers in processes of their own (under torchrun, or on
    GPUs placed apart from this process), taking half of each card they share with a trainer."""
    from eyas.engines import load_engine
    from eyas.utils.devices import resolve_dtype

    dtype = str(resolve_dtype(opts.target_dtype, info.device)).removeprefix("torch.")
    extra, cuda = dict(opts.target_options), info.device.type == "cuda"
    kw = dict(aux_layer_ids=opts.aux_layer_ids, dtype=dtype, trust_remote_code=opts.trust_remote_code)
    if opts.engine == "hf" and opts.device_map is None:
        device = f"cuda:{opts.target_gpus[0]}" if cuda and opts.target_gpus else str(info.device)
        return load_engine("hf", model, device=device, **kw, **extra)
    gpus = target_gpus(opts.target_gpus, opts.tp if opts.engine == "vllm" else None, trainers_per_node) \
        if cuda else None
    if opts.engine == "hf":
        device_map = hf_device_map(model, gpus, resolve_dtype(dtype, info.device), opts.trust_remote_code) \
            if opts.device_map == "auto" and gpus is not None else opts.device_map
        return load_engine("hf", model, device=str(info.device), device_map=device_map, **kw, **extra)
    if info.world > 1 or gpus is not None:  # not in this process, which holds a trainer (and its process group)
        extra["llm_kwargs"] = {"distributed_executor_backend": "mp", **extra.get("llm_kwargs", {})}
    if gpus is not None and set(gpus) & set(range(trainers_per_node)):
        extra.setdefault("gpu_memory_utilization", 0.5)  # the trainer keeps the other half
    extra.setdefault("max_model_len", max_len)
    extra.setdefault("max_num_batched_tokens", max(budget, max_len))  # a packed row's samples in one step
    extra.setdefault("max_num_seqs", min(256, extra["max_num_batched_tokens"]))
    with target_environment(gpus):
        return load_engine("vllm", model, tp=opts.tp, **kw, **extra)


def hf_device_map(model: str, gpus: list[int], dtype: torch.dtype, trust_remote_code: bool) -> dict[str, int]:
    """transformers' `device_map="auto"` limited to the target's GPUs (the trainers keep theirs)."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    memory = {g: torch.cuda.get_device_properties(g).total_memory * 9 // 10 for g in gpus}
    return infer_auto_device_map(empty, max_memory=memory, dtype=dtype,
                                 no_split_module_classes=getattr(empty, "_no_split_modules", None))
