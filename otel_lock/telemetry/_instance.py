"""`service.instance.id`: one per process, chosen again in a process forked after `setup()`.

With gunicorn ``--preload`` `setup()` runs in the master and every worker is
a fork of it: sharing the master's id, they would push one series each
under one identity, and the counters would jump between their values (the
OpenTelemetry resource conventions require the id to be unique). So in a
forked child the resource that `setup()` built, shared by the tracer and
meter providers, the OTLP push and ``target_info``, gets a new id before
anything is exported:

- an id `setup()` chose (hostname-pid-random) is chosen again;
- an id the caller gave (the argument or ``OTEL_RESOURCE_ATTRIBUTES``) is
  kept with ``-<pid>`` appended: it names the deployment the caller meant,
  and the pid tells the workers apart. A process that calls `setup()`
  itself keeps the id it is given, unchanged.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING

from .._fork import watch_fork

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

KEY = "service.instance.id"


def default_instance_id() -> str:
    """hostname-pid-random: unique per replica and per worker process, even across restarts."""
    chosen = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _chosen.add(chosen)
    return chosen


_chosen: set[str] = set()  # ids of this form made here: chosen again after a fork, never suffixed


class _Follower:
    """Renames the instance of `resource` in each forked child (kept alive in `_followed`)."""

    def __init__(self, resource: Resource) -> None:
        self._resource = resource
        self._given = str(resource.attributes.get(KEY, ""))
        self._generated = self._given in _chosen
        watch_fork(self.forked)

    def forked(self) -> None:
        instance = default_instance_id() if self._generated else f"{self._given}-{os.getpid()}"
        rename(self._resource, instance)


_followed: list[_Follower] = []


def follow_forks(resource: Resource) -> None:
    """From now on, a process forked from this one gets its own id in `resource`."""
    _followed[:] = [_Follower(resource)]


def rename(resource: Resource, instance: str) -> None:
    """Set the instance id of `resource` in place: every provider and exporter holds this very object."""
    from opentelemetry.sdk.resources import Resource

    renamed = Resource({**resource.attributes, KEY: instance}, resource.schema_url)
    resource._attributes = renamed._attributes  # Resource has no setter: the SDK's own field
