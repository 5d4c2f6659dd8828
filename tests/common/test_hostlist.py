"""Slurm host-list expansion and compression, with a cross-check against the real scontrol."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_train.common.hostlist import DEFAULT_MAX_HOSTS, compress, expand, first_host

EXPAND_CASES = [
    ("n1", ["n1"]),
    ("login", ["login"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[7]", ["n7"]),
    ("n[0-0]", ["n0"]),
    ("node[001-010]", [f"node{i:03d}" for i in range(1, 11)]),
    ("gpu[1,3,5-7]", ["gpu1", "gpu3", "gpu5", "gpu6", "gpu7"]),
    ("n[3,1-2]", ["n3", "n1", "n2"]),  # order inside a bracket is kept
    ("n[1-3,2]", ["n1", "n2", "n3", "n2"]),  # duplicates are kept, like scontrol
    ("n1,n1", ["n1", "n1"]),
    ("n[1-2],n[1-2]", ["n1", "n2", "n1", "n2"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
    ("a[1-2]b[3-4]c", ["a1b3c", "a1b4c", "a2b3c", "a2b4c"]),
    ("n[1-2].cluster.example.org", ["n1.cluster.example.org", "n2.cluster.example.org"]),
    ("n[1-2],gpu7,x[01-02]", ["n1", "n2", "gpu7", "x01", "x02"]),
    ("[1-3]", ["1", "2", "3"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ("n-[1-2]", ["n-1", "n-2"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n[099-101]", ["n099", "n100", "n101"]),
    ("n[98-100]", ["n98", "n99", "n100"]),  # numbers outgrow the width of the low bound
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),  # width is the low bound's, not the high's
    ("n[0001-3]", ["n0001", "n0002", "n0003"]),
    ("n[1-2,003-004]", ["n1", "n2", "n003", "n004"]),  # each range keeps its own padding
    ("n[0,00,000]", ["n0", "n00", "n000"]),
    ("n[00-01,2]", ["n00", "n01", "n2"]),
    ("n[123456789012345678901234567890]", ["n123456789012345678901234567890"]),
    ("é[1-2]", ["é1", "é2"]),
]

INVALID_CASES = [
    ("", "empty"),
    ("n[1-2", "never closed"),
    ("n1-2]", "without a matching '['"),
    ("n[1-2]]", "without a matching '['"),
    ("n[[1-2]]", "nested"),
    ("n[1-[2]]", "nested"),
    ("n[]", "empty range"),
    ("n[1,]", "empty range"),
    ("n[,1]", "empty range"),
    ("n[1,,2]", "empty range"),
    ("n[5-3]", "reversed range '5-3'"),
    ("n[010-009]", "reversed range"),
    ("n[a-b]", "'a-b'"),
    ("n[1-b]", "'1-b'"),
    ("n[x]", "'x'"),
    ("n[1-]", "'1-'"),
    ("n[-2]", "'-2'"),
    ("n[1--2]", "'1--2'"),
    ("n[1-2-3]", "'1-2-3'"),
    ("n[+1-2]", "'+1-2'"),
    ("n[1_0-12]", "'1_0-12'"),
    ("n[٣]", "'٣'"),  # a non-ASCII digit that int() would accept
    ("n[0x1]", "'0x1'"),
    ("n1,,n2", "empty host name"),
    (",n1", "empty host name"),
    ("n1,", "empty host name"),
    (",", "empty host name"),
    ("n[1-2] n3", "character ' ' at position 6"),
    (" n1", "character ' ' at position 0"),
    ("n1\n", "character '\\n'"),
    ("n\t1", "character '\\t'"),
    ("n\x00", "character '\\x00'"),
    ("n\x1b[1m", "character '\\x1b'"),
    ("n\x7f", "character '\\x7f'"),
    ("n\u2028", "character"),
    ("n[" + "1" * 65 + "]", "more than 64 digits"),
    ("n[1-" + "9" * 5000 + "]", "more than 64 digits"),  # int() alone would refuse > 4300 digits
    ("n[0-1000000]", "max_hosts=1,000,000"),
    ("n[0-999999],m1", "max_hosts=1,000,000"),
    ("a[0-999]b[0-9999]", "max_hosts=1,000,000"),
    ("n[0-99999999999999999999]", "max_hosts=1,000,000"),
]

COMPRESS_CASES = [
    (["n1"], "n1"),
    (["login"], "login"),
    (["n1", "n2", "n3"], "n[1-3]"),
    (["n1", "n2", "n3", "gpu7"], "n[1-3],gpu7"),  # scontrol keeps input order, it does not sort
    (["gpu7", "n1", "n2", "n3"], "gpu7,n[1-3]"),
    (["n3", "n1", "n2"], "n[3,1-2]"),
    (["n1", "n1"], "n[1,1]"),  # nor de-duplicate
    (["n1", "n2", "n1", "n2"], "n[1-2,1-2]"),
    (["n1", "m1", "n2", "m2"], "n1,m1,n2,m2"),  # only neighbours share a bracket
    (["n1", "n2", "x", "n3"], "n[1-2],x,n3"),
    (["a", "b", "a"], "a,b,a"),
    (["n1", "n3", "n5", "n6", "n7"], "n[1,3,5-7]"),
    ([f"node{i:03d}" for i in range(1, 11)], "node[001-010]"),
    (["n9", "n10", "n11"], "n[9-11]"),
    (["n09", "n10", "n11"], "n[09-11]"),
    (["n99", "n100"], "n[99-100]"),
    (["n099", "n100"], "n[099-100]"),
    (["n8", "n09"], "n[8,09]"),  # different padding is not merged into a range
    (["n9", "n010"], "n[9,010]"),
    (["n10", "n011"], "n[10,011]"),
    (["n1", "n02"], "n[1,02]"),
    (["n01", "n1", "n2", "n02"], "n[01,1-2,02]"),
    (["n0", "n00", "n000"], "n[0,00,000]"),
    (["n00", "n01", "n2"], "n[00-01,2]"),
    (["r1n01", "r1n02", "r2n01", "r2n02"], "r1n[01-02],r2n[01-02]"),  # only the last digit run is grouped
    (["a1b2", "a1b3", "a2b2"], "a1b[2-3],a2b2"),
    (["1", "2", "3"], "[1-3]"),
    (["n-1", "n-2"], "n-[1-2]"),
    (["foo.bar1", "foo.bar2"], "foo.bar[1-2]"),
    (["n", "n1"], "n,n1"),
    (["node1-ib", "node2-ib", "node4-ib"], "node[1-2,4]-ib"),
    (["n1x", "n2x"], "n[1-2]x"),
    (["n1.example.org", "n2.example.org"], "n[1-2].example.org"),
    (["node1-ib", "node1"], "node1-ib,node1"),
    (["n" + "1" * 64, "n" + "1" * 63 + "2"], "n[" + "1" * 64 + "-" + "1" * 63 + "2]"),
    (["n" + "1" * 65, "n" + "1" * 64 + "2"], "n" + "1" * 65 + ",n" + "1" * 64 + "2"),  # too long to be numbers
    (["n" + "1" * 5000], "n" + "1" * 5000),
    ([], ""),
]

# Without suffix grouping the output is exactly what `scontrol show hostlist` prints.
COMPRESS_NO_SUFFIX_CASES = [
    (["node1-ib", "node2-ib"], "node1-ib,node2-ib"),
    (["n1x", "n2x"], "n1x,n2x"),
    (["a1b2c", "a1b3c"], "a1b2c,a1b3c"),
    (["n1", "n2", "n3"], "n[1-3]"),
]

BAD_NAMES = ["", "n[1]", "n]", "n[", "a,b", "a b", "a\tb", "a\n", "a\x00", "a\x7f"]

# Valid for both Slurm 22.05 and this module (Slurm rejects text after the last bracket).
SCONTROL_EXPAND_CORPUS = [
    "n1", "login", "n[1-3]", "n[7]", "n[0-0]", "node[001-010]", "gpu[1,3,5-7]", "n[3,1-2]", "n[1-3,2]", "n1,n1",
    "n[1-2],n[1-2]", "r[1-2]n[01-02]", "n[1-2][3-4]", "n[1-2]x[3-4]", "n[1-2],gpu7,x[01-02]", "[1-3]",
    "10.0.0.[1-2]", "n-[1-2]", "n[9-11]", "n[09-11]", "n[099-101]", "n[98-100]", "n[1-010]", "n[0001-3]",
    "n[1-2,003-004]", "n[0,00,000]", "n[00-01,2]", "n[01-100]", "rack[1-3]node[001-004,010]",
    "a[1-2],b[01-03],c,d[7-9],n[0-4095]", "n[0-65535]",
]

# Rejected by both.
SCONTROL_INVALID_CORPUS = ["n[5-3]", "n[]", "n[a-b]", "n[1,]", "n[,1]", "n[[1-2]]", "n[1-2-3]", "n[-2]", "n[1--2]",
                           "n[1-2]]", "n[٣]"]


def _short(text: str) -> str:
    return text if len(text) < 40 else text[:37] + "..."


@pytest.mark.parametrize(("expr", "hosts"), EXPAND_CASES, ids=[_short(e) for e, _ in EXPAND_CASES])
def test_expand(expr: str, hosts: list[str]) -> None:
    assert expand(expr) == hosts
    assert first_host(expr) == hosts[0]


@pytest.mark.parametrize(("expr", "problem"), INVALID_CASES, ids=[ascii(e)[:40] for e, _ in INVALID_CASES])
def test_invalid_expression_names_expression_problem_and_syntax(expr: str, problem: str) -> None:
    for func in (expand, first_host):
        with pytest.raises(ValueError, match="valid syntax") as info:
            func(expr)
        message = str(info.value)
        assert repr(expr if len(expr) <= 120 else expr[:100]).rstrip("'") in message
        assert problem in message


def test_error_message_of_a_huge_expression_is_shortened() -> None:
    expr = ",".join(f"n{i}" for i in range(50_000)) + ",n[5-3]"
    with pytest.raises(ValueError, match="reversed range '5-3'") as info:
        expand(expr)
    assert len(str(info.value)) < 500
    assert f"<{len(expr)} characters>" in str(info.value)


def test_non_string_expression_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        expand(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str"):
        first_host(b"n[1-2]")  # type: ignore[arg-type]


def test_max_hosts_is_configurable_and_counts_the_whole_expression() -> None:
    assert DEFAULT_MAX_HOSTS == 1_000_000
    assert len(expand("n[1-10]", max_hosts=10)) == 10
    with pytest.raises(ValueError, match="max_hosts=9"):
        expand("n[1-10]", max_hosts=9)
    with pytest.raises(ValueError, match="max_hosts=5"):
        expand("n[1-3],m[1-3]", max_hosts=5)  # summed over items
    with pytest.raises(ValueError, match="max_hosts=8"):
        expand("r[1-3]n[1-3]", max_hosts=8)  # multiplied over groups
    with pytest.raises(ValueError, match="max_hosts=1"):
        first_host("n[1-2]", max_hosts=1)
    assert len(expand("n[0-999999]")) == 1_000_000
    assert first_host("n[5-2000004]", max_hosts=2_000_000) == "n5"


def test_first_host_of_a_huge_expression_is_fast_and_small() -> None:
    expr = "n[0-999999]"
    tracemalloc.start()
    try:
        started = time.perf_counter()
        host = first_host(expr)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert host == "n0"
    assert elapsed < 0.05
    assert peak < 100_000  # bytes; a million host strings would be tens of MB
    assert first_host("gpu[000100-999999],n[1-5]") == "gpu000100"
    assert first_host("r[7-9]n[0003-0900]-ib", max_hosts=10**9) == "r7n0003-ib"


def test_first_host_of_a_long_expression_is_fast() -> None:
    expr = ",".join(f"r{i}n[{i:05d}-{i + 3:05d}]" for i in range(100_000))  # 400k hosts, ~2 MB of text
    started = time.perf_counter()
    assert first_host(expr) == "r0n00000"
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(("hosts", "expr"), COMPRESS_CASES, ids=[_short(",".join(h)) for h, _ in COMPRESS_CASES])
def test_compress(hosts: list[str], expr: str) -> None:
    assert compress(hosts) == expr
    assert compress(iter(hosts)) == expr  # any iterable, consumed once
    if hosts:
        assert expand(expr) == hosts


@pytest.mark.parametrize(("hosts", "expr"), COMPRESS_NO_SUFFIX_CASES)
def test_compress_without_suffix_grouping(hosts: list[str], expr: str) -> None:
    assert compress(hosts, suffixes=False) == expr
    assert expand(expr) == hosts


@pytest.mark.parametrize("name", BAD_NAMES, ids=[ascii(n) for n in BAD_NAMES])
def test_compress_rejects_names_it_cannot_write(name: str) -> None:
    with pytest.raises(ValueError, match="cannot compress host name") as info:
        compress(["n1", name])
    assert repr(name) in str(info.value)


def test_compress_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="must be str"):
        compress(["n1", 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not one str"):
        compress("n[1-2]")  # a str would otherwise pass as an iterable of one-character names


def _random_hosts(rng: random.Random, *, suffixes: bool = True) -> list[str]:
    prefixes = ["n", "node", "gpu-", "r1n", "r2n", "", "x9y", "a.b"]
    tails = ["", "", "-ib", ".example.org", "x"] if suffixes else [""]
    hosts = []
    for _ in range(rng.randint(1, 60)):
        if rng.random() < 0.05:
            hosts.append(rng.choice(["login", "head", "mgmt-a"]))
            continue
        number = rng.choice([rng.randint(0, 20), rng.randint(0, 1200), rng.randint(0, 10**12)])
        hosts.append(rng.choice(prefixes) + str(number).zfill(rng.choice([0, 0, 1, 2, 3, 4])) + rng.choice(tails))
    return hosts


def test_round_trip_of_sorted_unique_hosts() -> None:
    rng = random.Random(20240601)  # noqa: S311 - seeded test data, not secrets
    for _ in range(400):
        hosts = sorted(set(_random_hosts(rng)))
        expr = compress(hosts)
        assert expand(expr) == hosts, expr
        assert compress(expand(expr)) == expr


def test_round_trip_keeps_any_order_and_duplicates() -> None:
    rng = random.Random(7)  # noqa: S311 - seeded test data, not secrets
    for _ in range(400):
        hosts = _random_hosts(rng)
        hosts += rng.sample(hosts, k=rng.randint(0, len(hosts)))
        for suffixes in (True, False):
            expr = compress(hosts, suffixes=suffixes)
            assert expand(expr) == hosts, expr
            assert first_host(expr) == hosts[0]


def test_round_trip_of_dense_ranges_is_one_group() -> None:
    rng = random.Random(3)  # noqa: S311 - seeded test data, not secrets
    for _ in range(100):
        low = rng.randint(0, 5000)
        width = rng.choice([0, 3, 5])
        hosts = [f"node{str(n).zfill(width)}-ib" for n in range(low, low + rng.randint(2, 500))]
        expr = compress(hosts)
        assert expr.count("[") == 1 and "," not in expr, expr
        assert expand(expr) == hosts


def test_compress_of_a_million_hosts() -> None:
    hosts = expand("n[0-999999]")
    assert compress(hosts) == "n[0-999999]"
    assert compress(hosts[:100_000:2]) == "n[" + ",".join(map(str, range(0, 100_000, 2))) + "]"


# ---- cross-check against the real Slurm tools --------------------------------------------------------------------


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], str]:
    """Run `scontrol show <what> <arg>`; host lists are parsed locally, no controller is needed.

    scontrol only insists on a readable slurm.conf (without one it retries for a minute), so the test
    brings a minimal one and does not depend on the test cluster being up.
    """
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("scontrol is not installed (Slurm client tools); the pure-Python tests still run")
    conf: Path = tmp_path_factory.mktemp("slurmconf") / "slurm.conf"
    conf.write_text("ClusterName=hostlisttest\nSlurmctldHost=localhost\n")

    def run(what: str, arg: str) -> str:
        done = subprocess.run([exe, "show", what, arg], capture_output=True, text=True, timeout=30, check=False,
                              env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"})
        return done.stdout + done.stderr

    if run("hostnames", "n[1-2]").split() != ["n1", "n2"]:
        pytest.skip(f"scontrol at {exe} cannot expand host lists here: {run('hostnames', 'n[1-2]')!r}")
    return run


def test_expand_matches_scontrol_show_hostnames(scontrol: Callable[[str, str], str]) -> None:
    assert len(SCONTROL_EXPAND_CORPUS) >= 20
    for expr in SCONTROL_EXPAND_CORPUS:
        assert expand(expr) == scontrol("hostnames", expr).split(), expr
        assert first_host(expr) == expand(expr)[0]


def test_invalid_expressions_are_invalid_for_scontrol_too(scontrol: Callable[[str, str], str]) -> None:
    for expr in SCONTROL_INVALID_CORPUS:
        assert "Invalid hostlist" in scontrol("hostnames", expr), expr  # scontrol exits 0 even then
        with pytest.raises(ValueError, match="invalid Slurm host list"):
            expand(expr)


def test_compress_matches_scontrol_show_hostlist(scontrol: Callable[[str, str], str]) -> None:
    cases = [hosts for hosts, _ in COMPRESS_CASES + COMPRESS_NO_SUFFIX_CASES
             if hosts and not re.search("[0-9]{19}", ",".join(hosts))]  # Slurm clamps numbers to 2**64-1
    rng = random.Random(11)  # noqa: S311 - seeded test data, not secrets
    cases += [_random_hosts(rng, suffixes=rng.random() < 0.3) for _ in range(60)]
    cases += [sorted(set(_random_hosts(rng, suffixes=False))) for _ in range(20)]
    for hosts in cases:
        joined = ",".join(hosts)
        expr = compress(hosts, suffixes=False)
        assert expr == scontrol("hostlist", joined).strip(), joined  # byte for byte
        assert scontrol("hostnames", expr).split() == hosts, expr
