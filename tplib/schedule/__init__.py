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
``torchio``       torch.distributed.pipelining's action CSV: :func:`to_torch`,
                  :func:`read_torch`, :func:`from_torch`
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
from tplib.schedule.torchio import (
    TorchAction,
    TorchOrder,
    from_torch,
    read_torch,
    to_torch,
    write_torch_csv,
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
    "TorchAction",
    "TorchOrder",
    "add_communication",
    "add_update",
    "covered_slices",
    "draw_schedule",
    "from_torch",
    "gpipe",
    "held_versions",
    "link_of",
    "make_schedule",
    "one_f_one_b",
    "parse_kind",
    "pipedream",
    "read_torch",
    "registered",
    "replay",
    "schedule_names",
    "terapipe",
    "to_torch",
    "two_bw",
    "validate",
    "write_torch_csv",
]
