"""Every Redis URL is checked once, up front, the same way for every command: exit 2 and one line, never a
traceback, never a silently ignored option, never localhost for an empty host."""

from __future__ import annotations

import pytest

from otel_lock.cli import main
from otel_lock.cli._redis_server import free_port

PORT = free_port()  # nothing listens: no URL here may reach a server
COMMANDS = [["doctor"], ["locks"], ["locks", "--json"], ["unlock", "k", "--reason", "r"]]
BAD = {
    "port-not-a-number": (f"redis://127.0.0.1:abc/0", "Port could not be cast"),
    "port-too-large": ("redis://127.0.0.1:99999/0", "Port out of range"),
    "bad-option-value": (f"redis://127.0.0.1:{PORT}/0?socket_timeout=abc", "Invalid value for 'socket_timeout'"),
    "bad-db-option": (f"redis://127.0.0.1:{PORT}/0?db=x", "Invalid value for 'db'"),
    "unknown-option": (f"redis://127.0.0.1:{PORT}/0?foo=bar", "unknown option foo"),
    "db-not-a-number": (f"redis://127.0.0.1:{PORT}/abc", "the database 'abc' is not a number"),
    "empty-host": (f"redis://:{PORT}/0", "no host"),
    "empty-host-with-password": (f"redis://:s3cret@:{PORT}/0", "no host"),
    "ipv6-unbracketed": (f"redis://::1:{PORT}/0", "in brackets"),
    "ipv6-unclosed": ("redis://[::1/0", "Invalid IPv6 URL"),
    "unix-without-path": ("unix://", "no socket path"),
}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_url_is_exit_2_with_one_line_for_every_command(command, case, capsys):
    url, expected = BAD[case]
    with pytest.raises(SystemExit) as exc:
        main([*command, "--redis-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and expected in last and "s3cret" not in err, err


GOOD = {  # named, not parametrized by URL: the port is drawn per process, and xdist's workers must collect alike
    "options": f"redis://127.0.0.1:{PORT}/0?socket_timeout=5&protocol=3",
    "tls-option": f"rediss://127.0.0.1:{PORT}/0?ssl_cert_reqs=none",
    "unix-with-db": "unix:///tmp/r.sock?db=1",
    "ipv6": f"redis://[::1]:{PORT}/2",
    "encoded-password": f"redis://u:p%40ss@127.0.0.1:{PORT}",
}


@pytest.mark.parametrize("case", list(GOOD))
def test_a_good_url_is_accepted(case):
    url = GOOD[case]
    from otel_lock.cli import build_parser

    assert build_parser().parse_args(["locks", "--redis-url", url]).redis_url == url
