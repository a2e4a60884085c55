"""``DistributedOptimizer``: averages gradients across ranks while backward is still running.

The returned object wraps the user's optimizer by composition (``OptimizerWrapper``): it shares
the wrapped optimizer's parameter groups and state and never copies its class, so
``isinstance(opt, torch.optim.Optimizer)`` holds and ``opt.optimizer`` is the wrapped one.

A post-accumulate-grad hook on every parameter counts backward passes; when a parameter has seen
``backward_passes_per_step`` of them its gradient's allreduce starts at once (asynchronously,
in place), so communication overlaps the rest of backward. With ``groups`` the members of a
group are reduced together as one grouped allreduce once all of them are ready. ``step()`` (or
``synchronize()``) starts whatever is still missing - parameters that got no gradient are
reduced as zeros, so every rank submits the same tensors - waits for everything and then steps
the wrapped optimizer. With ``op=Adasum`` on more than one rank the wrapped optimizer steps each
parameter inside its hook and the parameter *deltas* are combined with Adasum instead.

Hooks run in autograd's backward thread, everything else in the training thread; the two never
overlap (backward blocks the training thread), so no locking is needed. Not thread-safe.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hora import global_process_set
from hora.frameworks.grad_compression import GradientCompressor
from hora.frameworks.ops import Adasum, Average, Max, Min, Product, Sum, compression_for
from hora.torch.compression import Compression, Compressor
from hora.torch.grad_compression import compressed_step
from hora.torch.mpi_ops import (
    ProcessSet,
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.wrapper import OptimizerWrapper

_TOO_MANY_PASSES = (
    "a gradient was computed more often than backward_passes_per_step={n} allows before step(): "
    "call optimizer.step() (or synchronize()) after every {n} backward passes, or raise "
    "backward_passes_per_step to accumulate more passes locally"
)
# Horovod's text first, word for word, so that log filters and tests written for Horovod match.
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code. "
    "(hora: the gradients are reduced a second time; wrap the step in "
    "`with optimizer.skip_synchronize():`.)"
)
_ZERO_GRAD_PENDING = (
    "zero_grad() while gradient reductions are pending (loss.backward() ran but neither "
    "optimizer.step() nor optimizer.synchronize() has since): the reductions are writing those "
    "gradients; call step() or synchronize() first"
)


class _Flight:
    """One reduction in progress: a (grouped) in-place allreduce of some parameters' tensors."""

    def __init__(
        self, handle: Any, params: list[torch.Tensor], sent: list[torch.Tensor], ctxs: list[Any],
        comp: Any,
    ) -> None:  # fmt: skip
        self.handle, self.params, self.sent, self.ctxs, self.comp = handle, params, sent, ctxs, comp

    def finish(self, owner: _DistributedOptimizer) -> None:
        synchronize(self.handle)
        comp = self.comp
        for p, sent, ctx in zip(self.params, self.sent, self.ctxs):
            # a cast back to the gradient's dtype is made by _finish's copy, with no new tensor
            owner._finish(p, sent if getattr(comp, "casts_back", False) else
                          comp.decompress(sent, ctx))  # fmt: skip


class _SparseFlight:
    """A sparse gradient's reduction (allgather of indices and values)."""

    def __init__(self, result: Callable[[], torch.Tensor], param: torch.Tensor) -> None:
        self.result, self.params = result, [param]

    def finish(self, owner: _DistributedOptimizer) -> None:
        self.params[0].grad = self.result()


class _Local:
    """A world of one: nothing to communicate."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def finish(self, owner: _DistributedOptimizer) -> None:
        return None


def _hook(ref: weakref.ReferenceType[_DistributedOptimizer], param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:  # an optimizer that was dropped leaves harmless hooks behind
        owner._on_grad(param)


class _DistributedOptimizer(OptimizerWrapper):
    priorities: dict[torch.Tensor, int] = {}  # allreduce priority= per parameter (default 0)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: int | list[list[torch.Tensor]] | None,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        super().__init__(optimizer)
        if op not in (Average, Sum, Adasum, Min, Max, Product):
            raise ValueError(f"unknown op {op!r}: use hvd.Average, hvd.Sum or hvd.Adasum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor is only supported with op=Average")
        # PowerSGD, top-k: averages all gradients at synchronize(), with state of its own
        if isinstance(compression, type) and issubclass(compression, GradientCompressor):
            compression = compression()  # Compression.powersgd without arguments: defaults
        self._compressor = compression if isinstance(compression, GradientCompressor) else None
        if self._compressor is not None:
            if op != Average or gradient_predivide_factor != 1.0:
                raise ValueError(f"compression={self._compressor.kind} averages: use op=Average "
                                 "and no gradient_predivide_factor")  # fmt: skip
            compression = Compression.none
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise TypeError(
                "compression must be hvd.Compression.none, .fp16, .bf16, .powersgd(), .topk() "
                "or a Compressor with compress() and decompress()"
            )
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = global_process_set if process_set is None else process_set
        self._names = self._name_parameters(named_parameters)
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._group_of, self._members = self._make_groups(groups)
        self._ready: Counter[int] = Counter()
        self._handles: dict[torch.Tensor, Any] = {}
        self._densified: set[torch.Tensor] = set()  # sparse gradients sent dense this step
        self._synchronized = False
        self._should_synchronize = True
        self._hooked = self.process_set.included()
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._register_hooks(self._params)

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each parameter's name, by parameter: Horovod's name for this mapping, which scripts
        and Horovod's own tests read."""
        return self._names

    def _register_hooks(self, params: list[torch.Tensor]) -> None:
        if self._hooked:
            ref = weakref.ref(self)
            for p in params:
                p.register_post_accumulate_grad_hook(lambda param, ref=ref: _hook(ref, param))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters are reduced like the others
        (named ``noname.<group>.<index>`` unless ``named_parameters`` named them)."""
        super().add_param_group(param_group)
        g = len(self.param_groups) - 1
        group = self.param_groups[g]["params"]
        for i, p in enumerate(group):
            self._names.setdefault(p, f"noname.{g}.{i}")
        new = [p for p in group if p.requires_grad]
        self._params += new
        self._delay.update({p: self.backward_passes_per_step for p in new})
        self._register_hooks(new)

    # -- construction helpers -----------------------------------------------------------------
    def _name_parameters(
        self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
    ) -> dict[torch.Tensor, str]:
        if named_parameters is None:
            return {
                p: f"noname.{g}.{i}"
                for g, group in enumerate(self.param_groups)
                for i, p in enumerate(group["params"])
            }
        named = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
            raise ValueError(
                "named_parameters must hold (name, parameter) tuples, as "
                "model.named_parameters() yields"
            )
        dups = sorted(n for n, c in Counter(n for n, _ in named).items() if c > 1)
        if dups:
            raise ValueError(
                "parameter names in named_parameters must be unique; used more than once: "
                + ", ".join(map(str, dups))
            )
        named_ids = {id(p) for _, p in named}
        unnamed = [id(p) for g in self.param_groups for p in g["params"] if id(p) not in named_ids]
        if unnamed:
            raise ValueError(
                f"named_parameters leaves {len(unnamed)} of the optimizer's parameters not "
                f"named (Python ids {unnamed}); pass the whole model's named_parameters()"
            )
        return {p: str(n) for n, p in named}

    def _make_groups(
        self, groups: int | list[list[torch.Tensor]] | None
    ) -> tuple[dict[torch.Tensor, int], list[list[torch.Tensor]]]:
        if groups is None or groups == 0:
            return {}, []
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError(
                    f"groups must be a non-negative int or a list of lists, got {groups}"
                )
            n = min(groups, len(self._params)) or 1
            size, extra = divmod(len(self._params), n)
            members, start = [], 0
            for k in range(n):
                stop = start + size + (1 if k < extra else 0)
                members.append(self._params[start:stop])
                start = stop
        else:
            known = {id(p) for p in self._params}
            members = [list(g) for g in groups]
            seen: set[int] = set()
            for g in members:
                for p in g:
                    if id(p) not in known:
                        raise ValueError(
                            "groups contains a tensor that is not a trainable "
                            "parameter of this optimizer"
                        )
                    if id(p) in seen:
                        raise ValueError("a parameter appears in more than one group")
                    seen.add(id(p))
        members = [g for g in members if g]
        return {p: k for k, g in enumerate(members) for p in g}, members

    # -- the hooks --------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES.format(n=self.backward_passes_per_step))
        self._delay[p] -= 1
        if self._delay[p]:
            return
        k = self._group_of.get(p)
        if k is None:
            self._launch([p])
            return
        self._ready[k] += 1
        if self._ready[k] == len(self._members[k]):
            self._launch(self._members[k])

    def _launch(self, params: list[torch.Tensor]) -> None:
        if self.process_set.size() == 1 or self._compressor is not None:
            flight: Any = _Local(params)  # a compressor reduces them all in synchronize()
        elif len(params) == 1 and self._is_sparse(params[0]) and not self.sparse_as_dense:
            p = params[0]
            flight = _SparseFlight(
                sparse_allreduce_async(p.grad, self._names[p], self.op, self.process_set), p
            )
        else:
            tensors = [self._prepare(p) for p in params]
            comp = compression_for(self._compression, Compression.none)
            sent, ctxs = map(list, zip(*(comp.compress(t) for t in tensors)))
            prescale, postscale = 1.0, 1.0
            if self.op == Average:  # the core applies 1/size on top
                prescale = 1.0 / self.gradient_predivide_factor
                postscale = self.gradient_predivide_factor
            kw = {
                "op": self.op,
                "prescale_factor": prescale,
                "postscale_factor": postscale,
                "process_set": self.process_set,
                "priority": max(self.priorities.get(p, 0) for p in params),
            }
            if len(params) == 1:
                handle = allreduce_async_(sent[0], name=self._names[params[0]], **kw)
            else:
                name = f"{self._names[params[0]]}.group{self._group_of[params[0]]}"
                handle = grouped_allreduce_async_(sent, name=name, **kw)
            flight = _Flight(handle, params, sent, ctxs, comp)
        for p in params:
            self._handles[p] = flight

    @staticmethod
    def _is_sparse(p: torch.Tensor) -> bool:
        return p.grad is not None and p.grad.is_sparse

    def _prepare(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor to reduce for ``p``: its gradient (zeros if it has none, dense).

        A sparse gradient reduced densely (``sparse_as_dense``, or inside a group) is made
        sparse again in ``_finish``, so optimizers that need sparse gradients (SparseAdam)
        still get them."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            p.grad = p.grad.to_dense()
            self._densified.add(p)
        return p.grad

    def _finish(self, p: torch.Tensor, reduced: torch.Tensor) -> None:
        if reduced is not p.grad:
            p.grad.copy_(reduced)
        if p in self._densified:
            self._densified.discard(p)
            p.grad = p.grad.to_sparse()

    # -- public methods ---------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce gradients after every ``passes`` backward passes (accumulating locally)."""
        if not isinstance(passes, int) or passes <= 0:
            raise ValueError(f"backward_passes_per_step must be an int > 0, got {passes!r}")
        self.backward_passes_per_step = passes
        self._delay = {p: passes for p in self._params}

    def synchronize(self) -> None:
        """Finish every gradient's reduction now (starting those not started yet)."""
        if not self._hooked:
            return
        for p in self._params:
            if p not in self._handles:
                k = self._group_of.get(p)
                self._launch([p] if k is None else self._members[k])
        done: set[int] = set()
        for flight in self._handles.values():
            if id(flight) not in done:
                done.add(id(flight))
                flight.finish(self)
        if self._compressor is not None and self.process_set.size() > 1:
            compressed_step(self._compressor, self._params, self._names, self._prepare,
                            self._finish, self.process_set)  # fmt: skip
        self._clear_in_flight()
        self._synchronized = True

    def _clear_in_flight(self) -> None:
        self._handles.clear()
        self._densified.clear()
        self._ready.clear()
        self._delay = {p: self.backward_passes_per_step for p in self._params}

    def _drop_in_flight(self) -> None:
        """Forget every reduction started or counted since the last step (after a collective
        failed their handles are stale); elastic ``restore()``/``sync()`` call this."""
        self._clear_in_flight()
        self._synchronized = False

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` first,
        e.g. to clip the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, and a stateful compressor's under ``hora_compression``
        (error memory and factors: elastic commits and checkpoints keep them)."""
        state = super().state_dict()
        if self._compressor is not None:
            state["hora_compression"] = self._compressor.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        kept = state_dict.pop("hora_compression", None)
        super().load_state_dict(state_dict)
        if kept is not None and self._compressor is not None:
            self._compressor.load_state_dict(kept)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or any(d != self.backward_passes_per_step for d in self._delay.values()):
            raise AssertionError(_ZERO_GRAD_PENDING)
        super().zero_grad(set_to_none)


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """Adasum: each parameter is stepped locally in its hook; the deltas are Adasum-combined."""

    def _prepare(self, p: torch.Tensor) -> torch.Tensor:
        start = p.detach().clone()
        saved = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            self.optimizer.step()
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params
        delta = p.detach() - start
        p.data.copy_(start)  # the combined delta is applied in synchronize()
        return delta

    def _finish(self, p: torch.Tensor, reduced: torch.Tensor) -> None:
        p.data.add_(reduced)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return loss


def DistributedOptimizer(  # noqa: N802 - Horovod's name for a factory
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    priority: Any = None,
) -> _DistributedOptimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged (``op``) over the ranks.

    ``named_parameters`` (e.g. ``model.named_parameters()``) names the allreduce of each
    gradient; ``compression`` shrinks what travels; ``backward_passes_per_step`` accumulates that
    many backward passes locally before reducing; ``gradient_predivide_factor`` splits the
    averaging into a division before and after the sum; ``groups`` (a number of groups, or lists
    of parameters) reduces gradients in groups; sparse gradients are reduced by gathering every
    rank's indices and values unless ``sparse_as_dense`` sends them as dense tensors (the wrapped
    optimizer gets them back sparse either way);
    ``process_set`` reduces over a subset of ranks. ``num_groups`` is the deprecated spelling
    of an int ``groups``. ``priority`` (hora's addition) orders the gradients' allreduces among
    those ready in the same cycle: ``"forward"`` gives the optimizer's first parameters (the
    first layers, needed first by the next forward pass) the highest priority, a dict maps
    parameter names (``named_parameters``) to priorities, a callable maps a name to one.
    """
    if num_groups:
        warnings.warn("num_groups is deprecated: use groups=", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    ps = global_process_set if process_set is None else process_set
    cls = _DistributedOptimizer
    if op == Adasum and ps.size() > 1:
        cls = _DistributedAdasumOptimizer
    wrapped = cls(
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    if priority is not None:
        wrapped.priorities = _priorities(priority, wrapped._params, wrapped._names)
    return wrapped


def _priorities(
    priority: Any, params: list[torch.Tensor], names: dict[torch.Tensor, str]
) -> dict[torch.Tensor, int]:
    """``DistributedOptimizer(priority=...)`` as one int per parameter."""
    if priority == "forward":
        return {p: len(params) - i for i, p in enumerate(params)}
    if isinstance(priority, dict):
        unknown = sorted(set(priority) - set(names.values()))
        if unknown:
            raise ValueError(f"priority names parameters that the optimizer lacks: {unknown}")
        return {p: int(priority.get(names[p], 0)) for p in params}
    if callable(priority):
        return {p: int(priority(names[p])) for p in params}
    raise TypeError(
        f"priority must be 'forward', a dict of parameter names to ints or a callable, "
        f"got {priority!r}"
    )
