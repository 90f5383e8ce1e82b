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
    "bad-option-value": (f"redis://127.0.0.1:{PORT}/0?socket_timeout=abc",
                         "socket_timeout='abc' in the URL's query: expected a number of seconds above 0"),
    "bad-db-option": (f"redis://127.0.0.1:{PORT}/0?db=x", "db='x' in the URL's query: expected a database number"),
    "unknown-option": (f"redis://127.0.0.1:{PORT}/0?foo=bar", "unknown option foo"),
    "db-not-a-number": (f"redis://127.0.0.1:{PORT}/abc", "the database 'abc' is not a number"),
    "empty-host": (f"redis://:{PORT}/0", "no host"),
    "empty-host-with-password": (f"redis://:s3cret@:{PORT}/0", "no host"),
    "ipv6-unbracketed": (f"redis://::1:{PORT}/0", "in brackets"),
    "ipv6-unclosed": ("redis://[::1/0", "Invalid IPv6 URL"),
    "unix-without-path": ("unix://", "no socket path"),
    # Values redis-py keeps and trips on at the first command, or reads as something else than written.
    "cert-reqs-unknown": (f"rediss://127.0.0.1:{PORT}/0?ssl_cert_reqs=bogus",
                          "ssl_cert_reqs='bogus' in the URL's query: expected none, optional or required"),
    "check-hostname-not-a-bool": (f"rediss://127.0.0.1:{PORT}/0?ssl_check_hostname=maybe",
                                  "ssl_check_hostname='maybe' in the URL's query is not true or false"),
    "tls-version-unknown": (f"rediss://127.0.0.1:{PORT}/0?ssl_min_version=99",
                            "ssl_min_version='99' in the URL's query: expected an ssl.TLSVersion value"),
    "decode-responses-as-text": (f"redis://127.0.0.1:{PORT}/0?decode_responses=false",
                                 "decode_responses cannot be set in the URL's query"),
    "socket-timeout-negative": (f"redis://127.0.0.1:{PORT}/0?socket_timeout=-1",
                                "socket_timeout='-1' in the URL's query: expected a number of seconds above 0"),
    "socket-timeout-nan": (f"redis://127.0.0.1:{PORT}/0?socket_timeout=nan", "socket_timeout='nan'"),
    "health-check-negative": (f"redis://127.0.0.1:{PORT}/0?health_check_interval=-1",
                              "health_check_interval='-1' in the URL's query: expected a whole number of seconds"),
    "protocol-unknown": (f"redis://127.0.0.1:{PORT}/0?protocol=9", "protocol='9' in the URL's query: expected 2 or 3"),
    "max-connections-zero": (f"redis://127.0.0.1:{PORT}/0?max_connections=0", "max_connections='0'"),
    "encoding-unknown": (f"redis://127.0.0.1:{PORT}/0?encoding=bogus", "encoding='bogus'"),
    "password-in-query-not-echoed": (f"redis://127.0.0.1:{PORT}/0?password=s3cret&foo=bar", "unknown option foo"),
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
    "tls-options": f"rediss://127.0.0.1:{PORT}/0?ssl_cert_reqs=optional&ssl_check_hostname=false&ssl_min_version=771",
    "bool-options": f"redis://127.0.0.1:{PORT}/0?socket_keepalive=yes&retry_on_timeout=0&health_check_interval=0",
    "text-options": f"redis://127.0.0.1:{PORT}/0?client_name=api-1&encoding=latin-1",
    "unix-with-db": "unix:///tmp/r.sock?db=1",
    "ipv6": f"redis://[::1]:{PORT}/2",
    "encoded-password": f"redis://u:p%40ss@127.0.0.1:{PORT}",
}


@pytest.mark.parametrize("case", list(GOOD))
def test_a_good_url_is_accepted(case):
    url = GOOD[case]
    from otel_lock.cli import build_parser

    assert build_parser().parse_args(["locks", "--redis-url", url]).redis_url == url


@pytest.mark.parametrize("case", [c for c in BAD if "?" in BAD[c][0]])
def test_a_bad_query_option_is_refused_when_the_manager_is_built(case):
    """LockManager.from_url and RedLockManager.from_urls refuse the URL the CLI refuses, before any connect:
    `?ssl_cert_reqs=bogus` passed and failed at the first acquire, `?decode_responses=false` decoded."""
    from otel_lock import LockManager, RedLockManager

    url, expected = BAD[case]
    with pytest.raises(ValueError, match="bad Redis URL") as by_url:
        LockManager.from_url(url)
    with pytest.raises(ValueError, match="bad Redis URL") as by_urls:
        RedLockManager.from_urls([url, f"redis://127.0.0.1:{PORT}/1", f"redis://127.0.0.2:{PORT}/0"])
    for exc in (by_url, by_urls):
        assert expected in str(exc.value) and "s3cret" not in str(exc.value)


@pytest.mark.parametrize("case", list(GOOD))
def test_a_good_url_builds_a_manager(case):
    from otel_lock import LockManager

    LockManager.from_url(GOOD[case])  # nothing connects before the first call
