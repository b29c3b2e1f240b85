"""How a plan reads: `MemoryPlan` holds both modes' plans, the advice and the notes of a job, and reads as plain
lines (logs), the message of a refusal, or the tables `rmsft plan` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rmsft.memory_plan.arithmetic import ASSUMPTIONS, ModePlan
from rmsft.memory_plan.shapes import ModelShape
from rmsft.memory_plan.units import GiB, gib


@dataclass(frozen=True)
class MemoryPlan:
    """Both modes' plans for a job; `mode` is the job's own, the one `fits` and `advice` are about."""

    job: str
    mode: str
    accelerator: str
    model: ModelShape
    trainable_params: int
    plans: dict[str, ModePlan]
    advice: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ASSUMPTIONS
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def own(self) -> ModePlan:
        return self.plans[self.mode]

    @property
    def fits(self) -> bool:
        return self.own.fits

    def message(self) -> str:
        """Why the job does not fit and what to turn (empty when it fits)."""
        if self.fits:
            return ""
        why = "; ".join(self.own.failures())
        knobs = " ".join(self.advice)
        return f"{self.job} does not fit ({self.mode} mode): {why}. {knobs}".strip()

    def lines(self) -> list[str]:
        """The plan as plain lines (for logs)."""
        out = [
            f"memory plan of {self.job}: model {_params(self.model.total_params)} parameters "
            f"({self.model.source}), {_params(self.trainable_params)} trainable"
        ]
        for name, plan in self.plans.items():
            tag = "the job's mode" if name == self.mode else "for comparison"
            out.append(f"{name} ({tag}): {plan.layout}: {'fits' if plan.fits else 'does NOT fit'}")
            for d in plan.devices:
                cap = f" of {gib(d.capacity)}" if d.capacity is not None else ""
                phases = ", ".join(f"{p} {gib(d.total(p))}" for p in d.phases)
                out.append(f"  {d.count} x {d.role}: peak {gib(d.peak)}{cap} ({phases})")
        if self.advice:
            out.append(" ".join(self.advice))
        return out

    def render(self) -> Any:
        """A rich renderable: one table per mode (rows: components, columns: device and phase), then the
        verdict, the advice and the assumptions."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = [
            Text(
                f"memory plan of {self.job}: {_params(self.model.total_params)} parameters "
                f"({_params(self.model.vision_tower_params + self.model.aligner_params)} in the vision tower and "
                f"aligner), {_params(self.trainable_params)} trainable; counts from {self.model.source}"
            )
        ]
        for name, plan in self.plans.items():
            own = name == self.mode
            verdict = "[green]fits[/green]" if plan.fits else "[red]does NOT fit[/red]"
            title = f"{name} mode ({'the job' if own else 'for comparison, same GPUs'}): {plan.layout}: {verdict}"
            parts.append(Text.from_markup(title))
            table = Table(show_lines=False, pad_edge=False)
            table.add_column("GiB per device", no_wrap=True)
            columns = [(d, p) for d in plan.devices for p in d.phases]
            for d, p in columns:
                table.add_column(f"{d.role} x{d.count}\n{p}", justify="right")
            rows: list[str] = []
            for d, p in columns:
                rows.extend(k for k in d.phases[p] if k not in rows)
            for row in rows:
                table.add_row(row, *(_num(d.phases[p].get(row)) for d, p in columns))
            table.add_row("[bold]total[/bold]", *(f"[bold]{_num(d.total(p))}[/bold]" for d, p in columns))
            table.add_row("capacity", *(_num(d.capacity) if d.capacity is not None else "-" for d, p in columns))
            parts.append(table)
            for d in plan.devices:
                for note in (*d.notes, *d.problems):
                    parts.append(Text(f"  {d.role}: {note}"))
                if d.host_bytes:
                    parts.append(Text(f"  {d.role}: {gib(d.host_bytes)} of host memory per device (offload / sleep)"))
            for failure in plan.failures():
                parts.append(Text(f"  does not fit: {failure}", style="red"))
        if self.advice:
            parts.append(Text(" ".join(self.advice), style="yellow"))
        for note in self.notes:
            parts.append(Text(note))
        parts.append(Text("assumptions:", style="dim"))
        parts.extend(Text(f"  - {a}", style="dim") for a in self.assumptions)
        return Group(*parts)


def _num(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)
