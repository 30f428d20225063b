"""Which runs a word on the command line names: a run, a step or a group.

`substrax-compute status|logs|cancel WORD` take a run id, a step name, a
group name (the `fit` of steps named `fit:a`, `fit:b`, ...) or a unique
prefix of a run id. A word could be more than one of these (run ids start
with their step's name), so it is tried in this order, first match wins:

1. an exact run id;
2. a step name (commands act on its latest run);
3. a group name (commands act on the latest run of each member);
4. a prefix of exactly one run id (several is an error naming them).

An exact id comes first because it can only mean that run; a step before
a prefix because `fit` should mean "the fit step", not "the runs whose ids
start with fit"; a step before a group only matters when a store holds runs
of a plain step `fit` from before it became a sweep, and then the group's
members are still named one by one (`fit:a`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from substrax_tasks.errors import HandleError, NoSuchRun

if TYPE_CHECKING:
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.run_store import RunStore

Kind = Literal["run", "step", "group"]
# How many names an error lists before it says "and N more".
MAX_NAMES_SHOWN = 20


def group_of(step: str) -> str | None:
    """The group of a step named "group:member" (split at the first ':',
    as doit and step.doit_name do), None for a step of no group."""
    group, colon, _ = step.partition(":")
    return group if colon else None


def latest_per_step(handles: Sequence[RunHandle]) -> list[RunHandle]:
    """The latest run of each step, in the order the runs were created."""
    latest: dict[str, RunHandle] = {}
    for handle in sorted(handles, key=lambda h: (h.created_at, h.run_id)):
        latest[handle.step] = handle
    return sorted(latest.values(), key=lambda h: (h.created_at, h.run_id))


@dataclass(frozen=True)
class Selection:
    """What a word resolved to: `kind` and `name` (the run id, the step or
    the group), and `runs`, every run it covers, oldest first."""

    kind: Kind
    name: str
    runs: tuple[RunHandle, ...]

    def latest(self) -> list[RunHandle]:
        """What logs and cancel act on: the run itself, the step's latest
        run, or the latest run of each member of the group."""
        return latest_per_step(self.runs)

    @property
    def steps(self) -> list[str]:
        return sorted({h.step for h in self.runs})


def select(
    store: RunStore,
    word: str,
    *,
    steps_only: bool = False,
    handles: Callable[[], Sequence[RunHandle]] | None = None,
) -> Selection:
    """Resolve `word` in the order the module docstring gives. With
    `steps_only` (`status --step`) only step and group names count.
    `handles` gives the store's readable handles (default: read them);
    an exact run id is answered without reading the others."""
    if not steps_only and store.exists(word):
        return Selection("run", word, (store.read(word),))
    every = list(handles() if handles is not None else store.read_all()[0])
    of_step = tuple(h for h in every if h.step == word)
    if of_step:
        return Selection("step", word, of_step)
    of_group = tuple(h for h in every if group_of(h.step) == word)
    if of_group:
        return Selection("group", word, of_group)
    if steps_only:
        raise HandleError(f"no runs of a step or group named {word!r}; {known_names(every)}")
    try:
        run_id = store.resolve(word)  # an ambiguous prefix raises, naming the runs
    except NoSuchRun:
        raise NoSuchRun(
            f"no run, step or group named {word!r} in {store.runs_dir}; {known_names(every)}; "
            "`substrax-compute status --all` lists every run"
        ) from None
    return Selection("run", run_id, (store.read(run_id),))


def known_names(handles: Sequence[RunHandle]) -> str:
    """The step and group names a store has runs of, for an error message."""
    steps = sorted({h.step for h in handles})
    groups = sorted({g for g in map(group_of, steps) if g is not None})
    if not steps:
        return "there are no runs yet"
    text = f"steps with runs: {shortened(steps)}"
    return f"{text}; groups: {shortened(groups)}" if groups else text


def shortened(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    rest = len(names) - MAX_NAMES_SHOWN
    return f"{shown} and {rest} more" if rest > 0 else shown
