"""An error raised on one process of a torchrun tool arrives on every process with its class
(the most derived one :mod:`shardckpt.errors` defines) and its message, so every process, and
the command, fails alike. Runs inside the suites' shared 2-rank job."""

from __future__ import annotations

from typing import Any, Callable

from testing.ranks import case_suite, check_case


def _raised_on_rank_1(make: Callable[[], Exception], world: int) -> tuple[type, str]:
    import torch.distributed as dist

    from shardckpt.tools.distributed import Job

    job = Job(dist.get_rank(), world)

    def work() -> None:
        if job.rank == 1:
            raise make()

    try:
        job.agree(work, "reshard: opening the source")
    except Exception as e:  # noqa: BLE001 - the class is what the case checks
        return type(e), str(e)
    raise AssertionError("no rank raised")


def case_classes(pm: Any) -> list[str]:
    from shardckpt.errors import ConfigError, IntegrityError, NotFoundError
    from shardckpt.format.quantities import QuantityError

    problems = []
    expect = [
        (lambda: NotFoundError("s3://b/run/manifest.json: not found"), NotFoundError,
         "s3://b/run/manifest.json: not found"),
        (lambda: IntegrityError("shard-00001-of-00002.safetensors: CRC32C mismatch"), IntegrityError,
         "shard-00001-of-00002.safetensors: CRC32C mismatch"),
        (lambda: QuantityError("--buffer", "x", "expected a size"), ConfigError,
         "--buffer x: expected a size"),
    ]
    for make, cls, text in expect:
        got, message = _raised_on_rank_1(make, pm.world_size)
        if got is not cls or message != text:
            problems.append(f"rank 1 raised {cls.__name__}({text!r}); this rank saw "
                            f"{got.__name__}({message!r})")
    return problems


CASES = {"classes": case_classes}


def cases_for(world: int) -> list[str]:
    return ["classes"] if world == 2 else []


reports = case_suite(__name__, CASES, cases_for, [2], timeout_s=60, pg_timeout_s=60,
                     case_pg_timeout_s=60)


def test_errors_keep_their_class_and_message_across_processes(reports) -> None:
    check_case(reports, "classes")
