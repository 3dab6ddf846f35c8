"""Kubernetes' cron dialect: when a CronJob's schedule fires.

The CronJob controller reads `spec.schedule` with robfig/cron's standard parser, so this
reads the same dialect and no other: five fields (minute 0-59, hour 0-23, day of month
1-31, month 1-12 or JAN-DEC, day of week 0-6 or SUN-SAT, names in any case), each a list
of `*`, `?`, a value or a range `a-b`, with an optional step (`*/15`, `1-9/2`, and `5/15`
for `5-59/15`); or one of the macros @yearly (@annually), @monthly, @weekly, @daily
(@midnight) and @hourly. What other crons accept and robfig does not (a 6th field of
seconds, `L`, `W`, `#`, a day of week 7) is refused, as the API server would refuse it.
`@every <duration>` counts from the controller's last run, which a schedule alone does not
say, so it is refused too.

The day of month and the day of week are ORed when both are restricted and ANDed when
either is unrestricted (`*` or `?`, with no step above 1), as robfig matches them:
`0 0 13 * 5` fires on every 13th and every Friday, `0 0 * * 5` on Fridays only.

A schedule fires in `spec.timeZone` (an IANA name the tz database knows), else in UTC
(the kube-controller-manager's zone, UTC in every managed cluster we know of); a
`CRON_TZ=` or `TZ=` prefix, which robfig reads and the API server discourages, names the
zone where `spec.timeZone` does not, and beside it is an error. The fire times themselves
are croniter's, daylight saving included.

Errors are `ScheduleError`s that name the field and what is wrong with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

MACROS: Mapping[str, str] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# A robfig cron finds no fire time in five years: a schedule such as `0 0 30 2 *` never fires.
_YEARS_SEARCHED = 5
_ITEM = re.compile(r"^(?P<range>\*|\?|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/(?P<step>[0-9]+))?$")
_ZONE_PREFIX = re.compile(r"^(?:CRON_TZ|TZ)=(?P<zone>\S+)\s+")


@dataclass(frozen=True, slots=True)
class CronField:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # names of low, low + 1, ...


FIELDS = (
    CronField("minute", 0, 59),
    CronField("hour", 0, 23),
    CronField("day of month", 1, 31),
    CronField("month", 1, 12, _MONTHS),
    CronField("day of week", 0, 6, _DAYS),
)


class ScheduleError(ValueError):
    """A schedule or time zone Kubernetes' CronJob controller cannot read: `field` is the
    CronJob field at fault (spec.schedule, spec.timeZone), `cron_job` the CronJob's
    namespace/name where known."""

    def __init__(self, field: str, message: str, cron_job: str | None = None) -> None:
        self.field = field
        self.reason = message
        self.cron_job = cron_job
        where = f"CronJob {cron_job}: " if cron_job else ""
        super().__init__(f"{where}{field}: {message}")

    def of(self, cron_job: str) -> ScheduleError:
        """The same error, naming the CronJob it was found in."""
        return ScheduleError(self.field, self.reason, cron_job)


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """A schedule read: the five fields as croniter reads them, whether the days are ORed,
    and the zone it fires in."""

    text: str  # as written
    fields: tuple[str, ...]
    day_or: bool
    zone: ZoneInfo = field(default_factory=lambda: ZoneInfo("UTC"))

    def fire_times(self, after: datetime, until: datetime, limit: int = 1000) -> list[datetime]:
        """When it fires after `after` up to `until` included (at most `limit` times), in
        UTC. Naive moments are read as UTC."""
        start, end = _utc(after), _utc(until)
        found: list[datetime] = []
        if end <= start:
            return found
        times = croniter(
            " ".join(self.fields),
            start.astimezone(self.zone),
            day_or=self.day_or,
            max_years_between_matches=_YEARS_SEARCHED,
        )
        try:
            while len(found) < limit:
                moment = times.get_next(datetime).astimezone(UTC)
                if moment > end:
                    break
                found.append(moment)
        except CroniterBadDateError:
            pass  # no fire time within the years searched: it never fires
        return found


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def time_zone(name: str) -> ZoneInfo:
    """The zone `spec.timeZone` names; a ScheduleError when the tz database has none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(
            "spec.timeZone", f"{name!r} is not a time zone the tz database knows"
        ) from None


def _value(text: str, spec: CronField, schedule: str) -> int:
    if text.isdigit():
        value = int(text)
    elif text.lower() in spec.names:
        value = spec.low + spec.names.index(text.lower())
    else:
        raise _bad(schedule, f"{spec.name} field: {text!r} is not a number or a name")
    if not spec.low <= value <= spec.high:
        raise _bad(schedule, f"{spec.name} field: {value} is outside {spec.low}-{spec.high}")
    return value


def _bad(schedule: str, message: str) -> ScheduleError:
    return ScheduleError("spec.schedule", f"{schedule!r}: {message}")


def _field(text: str, spec: CronField, schedule: str) -> tuple[str, bool]:
    """One field as croniter reads it (numbers only), and whether robfig counts it as
    unrestricted (a `*` or `?` with no step above 1)."""
    items: list[str] = []
    star = False
    for item in text.split(","):
        match = _ITEM.match(item)
        if match is None:
            raise _bad(schedule, f"{spec.name} field: {item!r} is not a value, range or step")
        written, step_text = match["range"], match["step"]
        step = int(step_text) if step_text is not None else 1
        if step_text is not None and step == 0:
            raise _bad(schedule, f"{spec.name} field: the step of {item!r} must be positive")
        if written in ("*", "?"):
            low, high = spec.low, spec.high
            star = star or step == 1
        else:
            first, _, last = written.partition("-")
            low = _value(first, spec, schedule)
            # robfig: `N/step` runs from N to the field's maximum.
            high = _value(last, spec, schedule) if last else (spec.high if step_text else low)
            if low > high:
                raise _bad(schedule, f"{spec.name} field: {item!r} starts after it ends")
        # croniter reads `0-0` as every minute: a single value is written as one.
        span = str(low) if low == high else f"{low}-{high}"
        items.append(f"{span}/{step}" if step > 1 and low < high else span)
    return ",".join(items), star


def parse_schedule(schedule: str, zone: str | None = None) -> CronSchedule:
    """`schedule` (a CronJob's spec.schedule) and `zone` (its spec.timeZone, None: unset)
    read as the CronJob controller reads them; a ScheduleError names what it cannot read."""
    text = schedule.strip()
    prefix = _ZONE_PREFIX.match(text)
    if prefix is not None:
        if zone is not None:
            raise _bad(schedule, "a TZ or CRON_TZ prefix cannot be used with spec.timeZone")
        zone, text = prefix["zone"], text[prefix.end() :]
    where = time_zone(zone) if zone is not None else ZoneInfo("UTC")
    if text.startswith("@"):
        macro = text.split()[0].lower()
        if macro == "@every":
            raise _bad(schedule, "@every counts from the controller's last run, which is not known")
        if macro not in MACROS or len(text.split()) != 1:
            raise _bad(schedule, f"unknown macro {text!r} (one of {', '.join(MACROS)})")
        text = MACROS[macro]
    parts = text.split()
    if len(parts) != len(FIELDS):
        raise _bad(schedule, f"{len(parts)} fields, where Kubernetes reads {len(FIELDS)}")
    read = [_field(part, spec, schedule) for part, spec in zip(parts, FIELDS, strict=True)]
    day_of_month, day_of_week = read[2][1], read[4][1]
    return CronSchedule(
        text=schedule,
        fields=tuple(f for f, _ in read),
        day_or=not (day_of_month or day_of_week),
        zone=where,
    )
