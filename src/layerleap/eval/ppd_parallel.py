"""PPD on real parallel compute units: a main process and ``k`` sub-processes, each with its own copy of
the model, exchanging candidate tokens, hidden states and KV entries over ``torch.distributed`` (gloo on
CPU), as Algorithm 2 of Yang et al. (2023) says (Algorithm 1 at d̄ = d/2).

Per token ``x_t`` (the caller's process is the main process, rank 0; sub-process ``i`` is rank ``i``):

1. main: layers ``[0, d̄)`` of ``x_t`` (from layer ``d - d̄`` when a sub-process's result was taken over);
2. main -> every sub-process: the early prediction (``head_on="main"``: the main process runs the exit
   head and sends candidate ``i`` to sub-process ``i``, as the paper; ``head_on="sub"``: it sends the
   layer-d̄ hidden state and each sub-process runs the exit head itself and returns its candidate, which
   keeps the exit head's unembedding (as costly as ~5 layers of SmolLM2) off the main process's
   critical path), plus the KV entries of ``x_t`` in layers ``[0, d - d̄)`` the sub-process lacks;
3. in parallel: main runs layers ``[d̄, d)`` of ``x_t`` -> ``x_{t+1}``; every sub-process runs its
   candidate through layers ``[0, d - d̄)``;
4. main -> sub-processes: which candidate (if any) equals ``x_{t+1}``; the matching sub-process sends
   its hidden state after layer ``d - d̄`` and its KV entries of those layers, which the main process
   writes into its own cache before continuing (step 1 from layer ``d - d̄``).

Every emitted token is the main process's own full-model argmax: the output is greedy decoding.

Timing: ``generate`` returns wall-clock time and, measured apart, the time the main process spent in
communication calls (sending, and waiting for a sub-process's result it takes over); ``ping_pong``
measures the round-trip cost of the messages alone.  Start-up and shutdown are clean: sub-processes
are daemons that stop on a stop message, on the main process closing the group, or on error, and
``close()`` (also on ``with`` exit, Ctrl-C or an exception) joins them after a finished generation,
and terminates them at once otherwise.  The sub-processes ignore Ctrl-C from their first instruction
(they start with SIGINT blocked): the terminal's interrupt reaches the whole process group, and only
the main process answers it, with one line.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import validate as V
from ..errors import LayerleapError
from ..methods.ppd import EXIT_LAYER, Clock, Runs, min_exit_layer, stats, top_candidates
from ..core import options as O

STOP, GO, ECHO = 0, 1, 2
HEAD_ON = ("main", "sub")


class ParallelError(LayerleapError, RuntimeError):
    """The multi-process executor cannot start or lost a process; the message says what to do."""


@dataclass
class ParallelResult:
    token_ids: list[int]
    text: str
    stats: dict = field(default_factory=dict)


# -- messages -------------------------------------------------------------------------------------
class Link:
    """Blocking point-to-point tensors on a gloo process group, with the main process's time in them."""

    def __init__(self, pg, rank: int):
        self.pg, self.rank = pg, rank
        self.comm_s = 0.0

    def send(self, t: torch.Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        self.pg.send([t.contiguous()], dst, 0).wait()
        self.comm_s += time.perf_counter() - t0

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pg.recv([t], src, 0).wait()
        self.comm_s += time.perf_counter() - t0
        return t

    def isend(self, t: torch.Tensor, dst: int):
        return self.pg.send([t.contiguous()], dst, 0)

    def irecv(self, t: torch.Tensor, src: int):
        return self.pg.recv([t], src, 0)


def _group(rank: int, size: int, port: int, timeout_s: float):
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return store, torch.distributed.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))


def _kv_rows(cache, layers: int, slot: int) -> torch.Tensor:
    """``[2, layers, Hkv, hd]``: keys and values of one slot in layers ``[0, layers)``."""
    return torch.stack([cache.k[:layers, 0, :, slot], cache.v[:layers, 0, :, slot]])


def _append_kv(cache, kv: torch.Tensor, layers: int) -> None:
    """Append one slot of keys/values ``[2, layers, Hkv, hd]`` to layers ``[0, layers)``."""
    for layer in range(layers):
        cache.write(layer, kv[0, layer].unsqueeze(0).unsqueeze(2), kv[1, layer].unsqueeze(0).unsqueeze(2))
    cache.advance(0, layers, 1)


# -- a sub-process --------------------------------------------------------------------------------
def _exit_with_parent() -> None:
    """A watchdog thread: when the main process is gone (killed without a chance to stop us), exit at
    once instead of waiting out the communication timeout."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


@contextmanager
def _sigint_blocked():
    """Start sub-processes that ignore SIGINT from their first instruction: a spawned process inherits
    an ignored signal (not a blocked one: its mask is reset), so a Ctrl-C while it imports torch
    cannot print a traceback; the main process answers it and stops them.  SIGINT stays blocked here
    meanwhile (Linux keeps a blocked signal pending whatever its disposition), so a Ctrl-C during the
    start reaches our own handler once it is back."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _sub_main(
    rank: int,
    size: int,
    port: int,
    model_src,
    dbar: int,
    head,
    head_on: str,
    threads: int,
    timeout_s: float,
    dtype: str = "float32",
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process answers Ctrl-C and stops us
    parent = os.getppid()
    _exit_with_parent()
    torch.set_num_threads(threads)
    from ..drafters.exit_heads import get_head
    from ..core.loading import load

    model = load(model_src, dtype=dtype, progress=lambda m: None) if isinstance(model_src, str) else model_src
    store, pg = _group(rank, size, port, timeout_s)
    link = Link(pg, rank)
    d = model.config.n_layers
    lo = d - dbar
    D = model.config.hidden_size
    c = model.config
    exit_head = get_head(model, dbar, head) if head_on == "sub" else None
    try:
        with torch.inference_mode():
            while True:  # one generation per loop; a header [cmd, prompt_len, max_len]
                hdr = link.recv(torch.zeros(3, dtype=torch.long), 0)
                if int(hdr[0]) == STOP:
                    break
                if int(hdr[0]) == ECHO:  # ping-pong: hdr[1] round trips of hdr[2] float32 values
                    buf = torch.zeros(int(hdr[2]))
                    for _ in range(int(hdr[1])):
                        link.send(link.recv(buf, 0), 0)
                    continue
                prompt = link.recv(torch.zeros(1, int(hdr[1]), dtype=torch.long), 0)
                cache = model.new_cache(1, int(hdr[2]))
                P = prompt.shape[1]
                model.run_layers(model.embed(prompt), 0, lo, torch.arange(P).unsqueeze(0), cache)
                kv_buf = torch.zeros(2, lo, c.n_kv_heads, c.head_dim, dtype=cache.k.dtype)
                pos = P  # position of the candidate x_{t+1}
                while True:
                    step = link.recv(torch.zeros(3, dtype=torch.long), 0)  # [cmd, has_kv, candidate]
                    if int(step[0]) == STOP:
                        break
                    if int(step[1]):
                        _append_kv(cache, link.recv(kv_buf, 0), lo)
                    if head_on == "sub":
                        h = link.recv(torch.zeros(1, 1, D, dtype=model.dtype), 0)
                        cand = int(top_candidates(exit_head(h)[0, -1], size - 1)[rank - 1])
                        link.send(torch.tensor([cand]), 0)
                    else:
                        cand = int(step[2])
                    h_lo = model.run_layers(model.embed(torch.tensor([[cand]])), 0, lo, torch.tensor([[pos]]), cache)
                    verdict = int(link.recv(torch.zeros(1, dtype=torch.long), 0))
                    if verdict == rank:  # taken over: send the state and the KV entries; keep them
                        link.send(h_lo, 0)
                        link.send(_kv_rows(cache, lo, pos), 0)
                    else:
                        cache.truncate(pos, layers=range(0, lo))
                    pos += 1
    except Exception as e:  # the main process went away (its error is the one to report) or a real failure
        if os.getppid() == parent and rank == 1:
            print(
                f"layerleap ppd sub-process {rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        del pg, store


# -- the main process -----------------------------------------------------------------------------
class ParallelPPD:
    """``k + 1`` processes running PPD.  ``model``: a packaged name (each process loads its own copy) or
    a ``Transformer`` (sent to the sub-processes, which then hold their own copy).  ``check(model)``, if
    given, runs on the main process's model before any sub-process starts (a raise starts none).  The
    caller's process runs ``threads`` torch threads from start-up until ``close()``, which gives its own
    count back."""

    def __init__(
        self,
        model,
        exit_layer: int | None = None,
        k: int = 1,
        head="auto",
        head_on: str = "sub",
        threads: int = 1,
        timeout_s: float = 120.0,
        dtype: str = "float32",
        check=None,
    ):
        from ..drafters.exit_heads import get_head
        from ..core.loading import load

        units = k + 1 if isinstance(k, int) and not isinstance(k, bool) else None
        cores = os.cpu_count() or 1
        if units is not None and units * threads > cores:
            raise ParallelError(
                f"PPD with k={k} needs {units} compute units × {threads} thread(s) = {units * threads} "
                f"cores; this machine has {cores}: lower k or --threads"
            )
        if head_on not in HEAD_ON:
            raise ParallelError(f"head_on must be one of {', '.join(HEAD_ON)}, got {head_on!r}")
        self.model = load(model, dtype=dtype, progress=lambda m: None) if isinstance(model, str) else model
        d = self.model.config.n_layers
        self.dbar = min_exit_layer(d) if exit_layer is None else exit_layer
        with V.raising(ParallelError):
            EXIT_LAYER.check(self.dbar, self.model.config)
            O.K.check(k, self.model.config)
        self.k, self.head_on, self.threads = k, head_on, threads
        self.exit_head = get_head(self.model, self.dbar, head)
        if check is not None:
            check(self.model)
        self.procs: list = []
        self._busy = False
        self._caller_threads = torch.get_num_threads()  # given back by close()
        torch.set_num_threads(threads)
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = _free_port()
        try:
            for rank in range(1, k + 1):
                p = ctx.Process(
                    target=_sub_main,
                    args=(rank, k + 1, port, model, self.dbar, head, head_on, threads, timeout_s, dtype),
                    daemon=True,
                )
                with _sigint_blocked():
                    p.start()
                self.procs.append(p)
            self.store, self.pg = _group(0, k + 1, port, timeout_s)
        except BaseException:
            self.close()
            raise
        self.link = Link(self.pg, 0)
        self._busy = False  # inside a generation (the sub-processes expect its messages)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop the sub-processes: between generations a stop message, then join (terminating any that
        hang); during start-up or a generation cut short (Ctrl-C, an error) terminate them at once.  The
        caller's torch thread count is back as it was before start-up."""
        pg = getattr(self, "pg", None)
        clean = pg is not None and not self._busy
        if clean:
            for rank in range(1, self.k + 1):
                try:
                    self.link.isend(torch.tensor([STOP, 0, 0]), rank).wait(datetime.timedelta(seconds=2))
                except Exception:  # a sub-process that is gone already: terminated below
                    pass
        for p in self.procs:
            if clean:
                p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.procs = []
        self.pg = None
        if getattr(self, "_caller_threads", None) is not None:
            torch.set_num_threads(self._caller_threads)
            self._caller_threads = None

    def _check_alive(self) -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise ParallelError(f"sub-process {dead[0].pid} exited (code {dead[0].exitcode}): see its message above")

    def ping_pong(self, n_values: int, repeats: int = 200) -> float:
        """Seconds per round trip of ``n_values`` float32 values to sub-process 1 and back, with no
        computation on either side: the communication cost measured apart from the model."""
        self._check_alive()
        link = self.link
        self._busy = True  # sub-process 1 expects the echo messages until the last
        link.send(torch.tensor([ECHO, repeats, n_values]), 1)
        buf = torch.randn(n_values)
        t0 = time.perf_counter()
        for _ in range(repeats):
            link.send(buf, 1)
            link.recv(buf, 1)
        self._busy = False
        return (time.perf_counter() - t0) / repeats

    def message_sizes(self) -> dict[str, int]:
        """float32-equivalent values of PPD's per-token messages on this model."""
        c = self.model.config
        kv = 2 * (c.n_layers - self.dbar) * c.n_kv_heads * c.head_dim
        return {"header": 3, "hidden": c.hidden_size, "kv_entries": kv, "hidden_and_kv": c.hidden_size + kv}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> ParallelResult:
        self._check_alive()
        model, link, k, dbar = self.model, self.link, self.k, self.dbar
        d = model.config.n_layers
        lo = d - dbar
        c = model.config
        eos = set(model.eos_ids()) if stop_at_eos else set()  # where generate ends (model.eos_ids)
        P = len(prompt_ids)
        max_len = P + max_new_tokens + 2
        cache = model.new_cache(1, max_len)
        link.comm_s = 0.0
        t0 = time.perf_counter()
        self._busy = True
        for rank in range(1, k + 1):
            link.send(torch.tensor([GO, P, max_len]), rank)
            link.send(torch.tensor([prompt_ids]), rank)
        ids = torch.tensor([prompt_ids])
        pos_all = torch.arange(P).unsqueeze(0)
        h = model.run_layers(model.embed(ids), 0, dbar, pos_all, cache)
        h_mid, h_full = h[:, -1:], h
        have_kv = [True] * (k + 1)  # sub-process i holds x_t's KV entries in layers [0, d - d̄)
        out: list[int] = []
        clock, runs = Clock(), Runs()
        clock.run_main(dbar)
        pos = P
        kv_buf = torch.zeros(2, lo, c.n_kv_heads, c.head_dim, dtype=cache.k.dtype)
        t_first = None
        while True:
            # hand out the early prediction (and the KV entries a sub-process lacks)
            cands = top_candidates(self.exit_head(h_mid)[0, -1], k) if self.head_on == "main" else None
            kv = _kv_rows(cache, lo, pos - 1) if not all(have_kv[1:]) else None
            for rank in range(1, k + 1):
                link.send(
                    torch.tensor([GO, int(not have_kv[rank]), int(cands[rank - 1]) if cands is not None else -1]), rank
                )
                if not have_kv[rank]:
                    link.send(kv, rank)
                if self.head_on == "sub":
                    link.send(h_mid, rank)
            bufs = [torch.zeros(1, dtype=torch.long) for _ in range(k)]
            got = [link.irecv(bufs[r - 1], r) for r in range(1, k + 1)] if self.head_on == "sub" else []
            clock.run_subs(k, lo)
            # the main process: layers [d̄, d) of x_t
            hs = h_full if h_full is not None else h_mid
            positions = pos_all if h_full is not None else torch.tensor([[pos - 1]])
            h = model.run_layers(hs, dbar, d, positions, cache)
            h_full = None
            clock.run_main(d - dbar)
            x = int(model.logits(h[:, -1:])[0, -1].argmax())
            if t_first is None:
                t_first = time.perf_counter()
            if got:  # the sub-processes' candidates (they arrived while the upper layers ran)
                t1 = time.perf_counter()
                for w in got:
                    w.wait()
                link.comm_s += time.perf_counter() - t1
                cands = torch.cat(bufs)
            out.append(x)
            done = len(out) >= max_new_tokens or x in eos
            j = None if done else next((i for i in range(k) if int(cands[i]) == x), None)
            for rank in range(1, k + 1):  # the verdict: which sub-process's candidate was right (rank), or 0
                link.send(torch.tensor([j + 1 if j is not None else 0]), rank)
            if done:
                break
            runs.add(j is not None)
            at = torch.tensor([[pos]])
            if j is not None:  # take over sub-process j+1's state and KV entries
                h_lo = link.recv(torch.zeros(1, 1, c.hidden_size, dtype=model.dtype), j + 1)
                _append_kv(cache, link.recv(kv_buf, j + 1), lo)
                h_mid = model.run_layers(h_lo, lo, dbar, at, cache)
                clock.run_main(dbar - lo, after=clock.sub_done)
                have_kv = [True] + [r == j + 1 for r in range(1, k + 1)]
            else:
                h_mid = model.run_layers(model.embed(torch.tensor([[x]])), 0, dbar, at, cache)
                clock.run_main(dbar)
                have_kv = [True] + [False] * k
            pos += 1
        wall = time.perf_counter() - t0
        for rank in range(1, k + 1):  # end of this generation
            link.send(torch.tensor([STOP, 0, 0]), rank)
        self._busy = False
        st = stats(d, dbar, k, len(out), runs, clock, head=self.exit_head.kind).to_dict()
        st.update(
            method="ppd-parallel",
            units=k + 1,
            head_on=self.head_on,
            new_tokens=len(out),
            wall_s=wall,
            tokens_per_s=len(out) / wall if wall > 0 else 0.0,
            ttft_s=t_first - t0 if t_first else None,
            comm_s=link.comm_s,
            threads_per_unit=self.threads,
        )
        text = model.tokenizer.decode(out, skip_special_tokens=True) if model.tokenizer is not None else ""
        return ParallelResult(out, text, st)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
