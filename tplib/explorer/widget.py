"""The explorer as ipywidgets: fields for a scenario, the exploration below them.

Pick a paper setting (its fields fill in) or "custom", the cost source and the
planner's knobs; the output recomputes on every change. The widget holds no logic of
its own: it reads a :class:`~tplib.explorer.scenario.Scenario` from its fields, calls
:func:`~tplib.explorer.exploration.explore` and :func:`~tplib.explorer.plot.figure`, and
shows their results, or the scenario's error message when the fields describe none.

A plan can take seconds. With ``background=True`` (the notebook's) changes are planned
on a thread, so the kernel keeps taking edits: a status line says what is being planned
since when, and changes made meanwhile are coalesced into one recompute of the latest
fields, never queued one by one.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import os
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as ipw
import pandas as pd
from matplotlib.figure import Figure

from tplib.explorer.exploration import Exploration, explore
from tplib.explorer.plot import figure
from tplib.explorer.scenario import (
    CLUSTER,
    METHODS,
    Scenario,
    scenario_for_profile,
    scenario_for_setting,
)
from tplib.nn.configs import MODELS
from tplib.paper import SEQLEN_BATCH, SETTINGS, setting

__all__ = ["CUSTOM", "Explorer", "build_explorer"]

_CACHE_SIZE = 16  # explorations the widget keeps, oldest dropped first
PLAN_WIDTH = 48  # characters of a plan in the table; the text above holds it whole
_SOURCES = {"V100 cluster model": CLUSTER, "profile file": "profile"}
# The Scenario fields with a control of the same name.
_FIELDS = ("model", "seq_len", "pipeline_batch", "n_stages", "n_op", "n_data", "granularity")

_SettingKey = tuple[int, int]  # (Table-1 index, L): a Table-4 variant has its own L
# Not None: ipywidgets 8 shows a Dropdown whose value is None as blank, not as "custom".
CUSTOM: _SettingKey = (0, 0)


def _setting_options() -> list[tuple[str, _SettingKey]]:
    opts: list[tuple[str, _SettingKey]] = [("custom", CUSTOM)]
    for n, s in SETTINGS.items():
        opts.append(
            (f"{s.label}  (K={s.n_stages}, #Op={s.n_op}, #Data={s.n_data})", (n, s.seq_len))
        )
    for seq_len in SEQLEN_BATCH:  # Table 4: setting (5) at longer L, smaller batch
        if seq_len != SETTINGS[5].seq_len:
            opts.append((f"{setting(5, seq_len).label}  (Table 4)", (5, seq_len)))
    return opts


class Explorer(ipw.VBox):
    """The explorer widget. ``controls`` maps field names to their widgets; after each
    change ``exploration`` holds the result (or ``error`` the message) and ``runs``
    counts the recomputations; ``status`` says what is being planned, or how long the
    shown result took. ``background``: plan on a thread (see the module's docstring)."""

    def __init__(
        self,
        initial: Scenario | None = None,
        *,
        show_figure: bool = True,
        background: bool = False,
    ) -> None:
        initial = initial or scenario_for_setting(9)
        style = {"description_width": "initial"}
        small = ipw.Layout(width="150px")
        self.setting = ipw.Dropdown(
            options=_setting_options(),
            description="paper setting",
            style=style,
            layout=ipw.Layout(width="470px"),
        )
        self.controls: dict[str, ipw.ValueWidget] = {
            "model": ipw.Dropdown(options=list(MODELS), description="model", style=style),
            "seq_len": ipw.BoundedIntText(min=1, max=1 << 20, description="L", layout=small),
            "pipeline_batch": ipw.BoundedIntText(
                min=1, max=1 << 16, description="B/#Data", style=style, layout=small
            ),
            "n_stages": ipw.BoundedIntText(
                min=1, max=1024, description="#Pipe K", style=style, layout=small
            ),
            "n_op": ipw.BoundedIntText(min=1, max=8, description="#Op", layout=small),
            "n_data": ipw.BoundedIntText(min=1, max=1024, description="#Data", layout=small),
            "granularity": ipw.BoundedIntText(min=1, max=4096, description="g", layout=small),
            "source": ipw.ToggleButtons(options=list(_SOURCES), description="cost", style=style),
            "profile": ipw.Text(
                placeholder="path/to/profile.json",
                description="profile",
                continuous_update=False,
                layout=ipw.Layout(width="420px"),
            ),
            "method": ipw.Dropdown(
                options=list(METHODS), description="method", layout=ipw.Layout(width="200px")
            ),
            "eps_ms": ipw.BoundedFloatText(
                min=0.0, max=1e6, step=0.05, description="eps (ms)", style=style, layout=small
            ),
        }
        self.show_figure = show_figure
        self.background = background
        self.status = ipw.HTML()
        self.output = ipw.Output()
        self._lock = threading.Lock()
        self._pending = False  # a change arrived that no recompute has read yet
        self._worker: threading.Thread | None = None
        self.exploration: Exploration | None = None
        self.error: str | None = None
        self.runs = 0
        self._quiet = False  # see _quietly
        # Keyed by the profile file's mtime too: a re-measured profile is a new scenario.
        # Revisiting a scenario is instant; the oldest go first: timelines are megabytes.
        self._explore = functools.lru_cache(maxsize=_CACHE_SIZE)(_explore_file_version)
        c = self.controls
        super().__init__(
            [
                ipw.HBox([self.setting, c["model"]]),
                ipw.HBox([c[k] for k in _FIELDS[1:]]),  # the model sits beside the setting
                ipw.HBox([c["source"], c["profile"]]),
                ipw.HBox([c["method"], c["eps_ms"]]),
                self.status,
                self.output,
            ]
        )
        self.set_scenario(initial)
        self.setting.observe(self._on_setting, names="value")
        for name in (*_FIELDS, "method", "eps_ms"):
            c[name].observe(self._on_field, names="value")
        c["source"].observe(self._on_source, names="value")
        c["profile"].observe(self._on_profile, names="value")
        self._request()

    # -- reading and writing the fields --

    def scenario(self) -> Scenario:
        """The scenario the fields describe (ValueError if they describe none)."""
        c = self.controls
        values = {k: c[k].value for k in _FIELDS}
        source = _SOURCES[c["source"].value]
        cost = CLUSTER if source == CLUSTER else c["profile"].value.strip()
        if source != CLUSTER and not cost:
            raise ValueError("cost source is a profile file: enter its path")
        return Scenario(**values, cost=cost, eps=c["eps_ms"].value * 1e-3, method=c["method"].value)

    def set_scenario(self, sc: Scenario) -> None:
        """Fill every field from ``sc`` (one recompute afterwards, if already built)."""
        with self._quietly():
            ctl = self.controls
            if sc.model not in ctl["model"].options:  # a profiled model outside MODELS
                ctl["model"].options = [*ctl["model"].options, sc.model]
            for k in _FIELDS:
                ctl[k].value = getattr(sc, k)
            ctl["method"].value, ctl["eps_ms"].value = sc.method, sc.eps * 1e3
            ctl["source"].value = "V100 cluster model" if sc.uses_cluster else "profile file"
            if not sc.uses_cluster:
                ctl["profile"].value = sc.cost
            self.setting.value = self._matching_setting(sc)
            self._sync_enabled()

    def _matching_setting(self, sc: Scenario) -> _SettingKey:
        for _, key in self.setting.options:
            if key != CUSTOM and sc.uses_cluster:
                ref = scenario_for_setting(*key)
                if all(getattr(ref, k) == getattr(sc, k) for k in _FIELDS):
                    return key
        return CUSTOM

    def _sync_enabled(self) -> None:
        profile = _SOURCES[self.controls["source"].value] != CLUSTER
        self.controls["profile"].disabled = not profile
        for k in ("n_op", "n_data"):  # a profile models neither
            self.controls[k].disabled = profile

    @contextmanager
    def _quietly(self) -> Iterator[None]:
        """Ignore field changes inside (nests): filling fields in bulk recomputes once."""
        before, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = before

    # -- reacting to changes --

    def _on_setting(self, change: dict[str, Any]) -> None:
        if self._quiet or change["new"] == CUSTOM:
            return
        ctl = self.controls
        sc = scenario_for_setting(
            *change["new"], eps=ctl["eps_ms"].value * 1e-3, method=ctl["method"].value
        )
        with self._quietly():
            self.set_scenario(sc)
        self._request()

    def _on_field(self, change: dict[str, Any]) -> None:
        if self._quiet:
            return
        with self._quietly():  # a hand-edited field leaves the paper setting
            try:
                self.setting.value = self._matching_setting(self.scenario())
            except ValueError:
                self.setting.value = CUSTOM
        self._request()

    def _on_source(self, change: dict[str, Any]) -> None:
        if self._quiet:
            return
        to_profile = _SOURCES[change["new"]] != CLUSTER
        with self._quietly():
            self._sync_enabled()
            if to_profile:
                self.controls["n_op"].value = self.controls["n_data"].value = 1
                self.setting.value = CUSTOM
        if to_profile and self.controls["profile"].value.strip():
            self._on_profile({"new": self.controls["profile"].value})
        else:
            self._request()

    def _on_profile(self, change: dict[str, Any]) -> None:
        if self._quiet:
            return
        ctl = self.controls
        try:  # adopt the profile's model and grid; keep the user's K and batch
            sc = scenario_for_profile(
                change["new"].strip(),
                n_stages=ctl["n_stages"].value,
                pipeline_batch=ctl["pipeline_batch"].value,
                method=ctl["method"].value,
                eps=ctl["eps_ms"].value * 1e-3,
            )
        except (ValueError, OSError):
            self._request()  # shows the error
            return
        with self._quietly():
            self.set_scenario(sc)
        self._request()

    def _request(self) -> None:
        """Recompute for a change: now, or (``background``) on the planning thread,
        which reads the fields when it gets to them, so changes that arrive while it
        plans coalesce into one more recompute."""
        if self._quiet:
            return
        if not self.background:
            self.recompute()
            return
        with self._lock:
            self._pending = True
            if self._worker is not None:
                return  # the running thread will pick the change up
            self._worker = threading.Thread(target=self._drain, daemon=True)
            self._worker.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._worker = None
                    return
                self._pending = False
            try:
                self.recompute()
            except Exception:  # a thread's traceback would go nowhere: show it
                self.exploration, self.error = None, traceback.format_exc()
                self.status.value = ""
                self.output.outputs = (_stream(f"the explorer failed:\n{self.error}"),)

    def recompute(self) -> None:
        """Explore the current fields and redraw the output area."""
        if self._quiet:
            return
        self.runs += 1
        try:
            sc = self.scenario()
        except ValueError as exc:
            self._show_error(exc)
            return
        started = time.perf_counter()
        self.status.value = (
            f"<i>planning {html.escape(sc.label)} (started {time.strftime('%H:%M:%S')}; the "
            "result below is the previous one)...</i>"
        )
        try:
            ex = self._explore(sc, None if sc.uses_cluster else os.stat(sc.cost).st_mtime_ns)
        except (ValueError, OSError) as exc:
            self._show_error(exc)
            return
        self.exploration, self.error = ex, None
        outputs = [_text(ex.describe()), _table(ex.summary(), plan_width=PLAN_WIDTH)]
        if self.show_figure:
            outputs.append(_png(figure(ex)))
        # Replacing the widget's outputs in one state update, rather than printing inside
        # `with self.output:`, needs no output capture: nothing flickers, it works from any
        # thread, and headless runs (papermill, nbclient) cannot lose the capture messages.
        self.output.outputs = tuple(outputs)
        self.status.value = f"explored in {time.perf_counter() - started:.2f} s"

    def _show_error(self, exc: Exception) -> None:
        self.exploration, self.error = None, str(exc)
        self.status.value = ""
        self.output.outputs = (_stream(f"cannot plan this: {exc}\n"),)


def _explore_file_version(sc: Scenario, profile_mtime_ns: int | None) -> Exploration:
    """:func:`explore`, keyed also by the profile file's modification time, so an edited
    profile is explored anew."""
    return explore(sc)


def _stream(text: str) -> dict[str, Any]:
    return {"output_type": "stream", "name": "stdout", "text": text}


def _text(text: str) -> dict[str, Any]:
    """``text`` that wraps between words where the panel is narrow (a stream output's
    lines break anywhere, mid-word)."""
    style = "white-space: pre-wrap; word-break: normal; overflow-wrap: break-word; margin: 0"
    body = f'<pre style="{style}">{html.escape(text)}</pre>'
    data = {"text/html": body, "text/plain": text}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def _table(df: pd.DataFrame, plan_width: int) -> dict[str, Any]:
    """``df`` rounded, its ``plan`` column cut to ``plan_width`` characters: a DP plan
    can run to hundreds, and the full one is in the text above the table."""
    shown = df.round(4)
    if "plan" in shown:
        shown["plan"] = [
            p if len(p) <= plan_width else p[: plan_width - 3] + "..." for p in shown.plan
        ]
    data = {"text/html": shown.to_html(), "text/plain": shown.to_string()}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def _png(fig: Figure) -> dict[str, Any]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    data = {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": repr(fig)}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def build_explorer(
    initial: Scenario | int | None = None, *, show_figure: bool = True, background: bool = False
) -> Explorer:
    """The explorer widget (an ``ipywidgets.VBox``), preselected with ``initial``: a
    :class:`Scenario`, a Table-1 setting number, or None for setting (9); ``background``
    plans changes on a thread (the notebook's choice)."""
    if isinstance(initial, int):
        initial = scenario_for_setting(initial)
    return Explorer(initial, show_figure=show_figure, background=background)
