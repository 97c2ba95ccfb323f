"""Pipeline schedules as data: each stage's ordered list of typed actions.

================  ===================================================================
module            what it holds
================  ===================================================================
``actions``       :class:`Kind`, :class:`Action`, :class:`Schedule` (and its CSV form)
``passes``        the passes that complete a generator's order, the 1F1B order
``generators``    ``gpipe``, ``terapipe``, ``1f1b`` and their zero-bubble forms
``asynchronous``  ``pipedream``, ``2bw``: many iterations, no flush, weight versions
``registry``      every schedule by name, :func:`make_schedule`
``engine``        the event engine: when each action runs, given durations
``nccl``          NCCL's rendezvous messages: the runtime's posting plan, its replay
``validate``      :func:`validate` and :func:`replay`
``drawing``       :func:`draw_schedule`, the stage x step drawing errors print
================  ===================================================================

Plain Python: the runtime interprets these schedules, the simulator replays them with
costs, the plots draw them, and the tests check them, all without a process group.
"""

from tplib.schedule.actions import (
    COMMUNICATION,
    COMPUTE,
    LOCAL_WORK,
    NO_UNIT,
    NO_VERSION,
    RECEIVES,
    SENDS,
    UPDATE,
    WHOLE_SEQUENCE,
    WORK,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    covered_slices,
    parse_kind,
)
from tplib.schedule.asynchronous import held_versions, pipedream, two_bw
from tplib.schedule.drawing import draw_schedule
from tplib.schedule.engine import TimedAction, link_of
from tplib.schedule.generators import gpipe, one_f_one_b, terapipe
from tplib.schedule.passes import add_communication, add_update
from tplib.schedule.registry import (
    REGISTRY,
    RegisteredSchedule,
    make_schedule,
    registered,
    schedule_names,
)
from tplib.schedule.validate import replay, validate

__all__ = [
    "COMMUNICATION",
    "COMPUTE",
    "LOCAL_WORK",
    "NO_UNIT",
    "NO_VERSION",
    "RECEIVES",
    "REGISTRY",
    "SENDS",
    "UPDATE",
    "WHOLE_SEQUENCE",
    "WORK",
    "Action",
    "Kind",
    "RegisteredSchedule",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "add_communication",
    "add_update",
    "covered_slices",
    "draw_schedule",
    "gpipe",
    "held_versions",
    "link_of",
    "make_schedule",
    "one_f_one_b",
    "parse_kind",
    "pipedream",
    "registered",
    "replay",
    "schedule_names",
    "terapipe",
    "two_bw",
    "validate",
]
