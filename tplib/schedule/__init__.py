"""Pipeline schedules as data: each stage's ordered list of typed actions.

================  ===================================================================
module            what it holds
================  ===================================================================
``actions``       :class:`Kind`, :class:`Action`, :class:`Schedule` (and its CSV form)
``generators``    ``gpipe``, ``terapipe``, ``1f1b`` and the passes that complete them
``asynchronous``  ``pipedream``, ``2bw``: many iterations, no flush, weight versions
``engine``        the event engine: when each action runs, given durations
``nccl``          NCCL's rendezvous messages: the runtime's posting plan, its replay
``validate``      :func:`validate` and :func:`replay`
``grid``          :func:`draw_schedule`, the stage x step drawing errors print
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
from tplib.schedule.asynchronous import ASYNC_SCHEDULES, held_versions, pipedream, two_bw
from tplib.schedule.drawing import draw_schedule
from tplib.schedule.engine import TimedAction, link_of
from tplib.schedule.generators import (
    SCHEDULES,
    add_communication,
    add_update,
    gpipe,
    make_schedule,
    one_f_one_b,
    terapipe,
)
from tplib.schedule.validate import replay, validate

__all__ = [
    "ASYNC_SCHEDULES",
    "COMMUNICATION",
    "COMPUTE",
    "LOCAL_WORK",
    "NO_UNIT",
    "NO_VERSION",
    "RECEIVES",
    "SCHEDULES",
    "SENDS",
    "UPDATE",
    "WHOLE_SEQUENCE",
    "WORK",
    "Action",
    "Kind",
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
    "replay",
    "terapipe",
    "two_bw",
    "validate",
]
