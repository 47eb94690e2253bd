"""S3 settings a user types on the command line or into S3Config: a region or endpoint that
botocore refuses is a ConfigError naming the field (rc 2 from the CLI, never a botocore
traceback); an endpoint's query string (where presigned tokens live) is refused and never
printed, also where botocore's own message repeats the URL; and ``S3://`` is the same scheme
for the CLI's ``--s3-endpoint`` check as for ``open_store``."""

from __future__ import annotations

import json

import pytest

from deltasync.cli import main
from deltasync.commands.inspect_store import local_path
from deltasync.commit import ReceiverRecord
from deltasync.errors import ConfigError, StoreError
from deltasync.store import S3Config, S3Store
from deltasync.store.s3 import make_client

SECRET = "SECRET123"
LEAKY = f"http://h/?X-Amz-Security-Token={SECRET}"
CREDS = {"access_key_id": "a", "secret_access_key": "b"}


@pytest.mark.parametrize("region", ["us east 1", "-us-east-1", "us-east-1-", "123", "a" * 64, ""])
def test_a_region_botocore_would_refuse_is_a_config_error_naming_the_field(region):
    with pytest.raises(ConfigError, match=r"S3Config\.region"):
        S3Config(region=region)


def test_a_client_botocore_refuses_to_build_is_a_config_error_in_the_library():
    cfg = S3Config(**CREDS)
    object.__setattr__(cfg, "region", "us east 1")  # past S3Config's own check: botocore's
    with pytest.raises(ConfigError, match=r"S3Config\.region 'us east 1' is refused by botocore"):
        S3Store("bkt", "run", config=cfg)
    with pytest.raises(ConfigError, match=r"could not be built.*Invalid endpoint"):
        S3Store("bkt", "run", config=S3Config(endpoint_url="http://exa mple.com", **CREDS))


def test_the_cli_refuses_an_invalid_region_with_rc_2_and_no_traceback(capsys):
    argv = ["inspect", "s3://bkt/run", "--s3-endpoint", "http://127.0.0.1:9"]
    assert main([*argv, "--s3-region", "us east 1"]) == 2
    err = capsys.readouterr().err
    assert "S3Config.region" in err and "us east 1" in err and "Traceback" not in err


@pytest.mark.parametrize("endpoint", [LEAKY, f"http://h:9000/s3#{SECRET}", "http://h/?"])
def test_an_endpoint_with_a_query_or_fragment_is_refused_and_shown_redacted(endpoint):
    with pytest.raises(ConfigError, match="query string or fragment") as exc:
        S3Config(endpoint_url=endpoint)
    assert SECRET not in str(exc.value) and "'http://h" in str(exc.value)


def test_the_cli_never_prints_an_endpoints_query_string(capsys):
    assert main(["inspect", "s3://bkt/run", "--s3-endpoint", LEAKY]) == 2
    captured = capsys.readouterr()
    assert "query string or fragment" in captured.err
    assert SECRET not in captured.err + captured.out


def test_a_botocore_message_that_repeats_the_endpoint_is_redacted_in_the_store_error():
    # The backstop behind S3Config's refusal: botocore's "Custom endpoint `URL` was not a
    # valid URI" repeats the URL verbatim, query string included.
    cfg = S3Config(endpoint_url="http://h/", **CREDS)
    object.__setattr__(cfg, "endpoint_url", LEAKY)
    store = S3Store("bkt", "run", config=cfg)
    with pytest.raises(StoreError) as exc:
        store.size("LATEST")
    assert "http://h/" in str(exc.value) and SECRET not in str(exc.value)


def test_one_scheme_parser_routes_store_urls_for_the_cli_and_open_store():
    from deltasync.store.factory import url_scheme

    assert [url_scheme(u) for u in ("S3://b/p", "s3://b", "File:///x", "/x", "memory://")] == [
        "s3",
        "s3",
        "file",
        "",
        "memory",
    ]
    assert str(local_path("FILE:///tmp/run")) == "/tmp/run"
    assert local_path("S3://b/p") is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", ["s3", "S3"])
def test_inspect_takes_s3_endpoint_with_an_upper_case_scheme(
    s3_server, monkeypatch, capsys, scheme
):
    bucket = s3_server.new_bucket()
    store = S3Store(bucket, "run", config=s3_server.config())
    rec = ReceiverRecord(receiver="pull-tp0", shard="tp0", version=None, updated_at=1.0)
    store.put(rec.key, rec.to_json())
    # the CLI reaches S3 with boto3's default credential chain (moto takes any credentials)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.SECRET_KEY)
    url = f"{scheme}://{bucket}/run"
    argv = ["inspect", url, "--s3-endpoint", s3_server.endpoint, "--s3-addressing-style", "path"]
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    info = json.loads(capsys.readouterr().out)
    assert [r["receiver"] for r in info["receivers"]] == ["pull-tp0"]


def test_the_cli_sets_the_s3_read_timeout_and_retry_deadline_its_errors_tell_to_raise(tmp_path):
    # "Raise S3Config.retry to wait longer" could not be acted on from the command line.
    import argparse

    from deltasync.commands.inspect_store import add_store_arguments, open_store_from_args

    parser = argparse.ArgumentParser()
    add_store_arguments(parser)
    endpoint = ["--s3-endpoint", "http://127.0.0.1:9"]
    tuned = ["--s3-read-timeout", "7.5", "--s3-retry-deadline", "120"]
    args = parser.parse_args(["s3://bkt/run", *endpoint, *tuned])
    store = open_store_from_args(args)
    assert store.config.read_timeout_s == 7.5 and store.config.retry.deadline_s == 120
    store.close()
    for flag, value in (("--s3-read-timeout", "-1"), ("--s3-retry-deadline", "nan")):
        bad = parser.parse_args(["s3://bkt/run", flag, value])
        with pytest.raises(ConfigError):
            open_store_from_args(bad)
        local = parser.parse_args([str(tmp_path), flag, "5"])
        with pytest.raises(ConfigError, match=f"{flag} only appl"):
            open_store_from_args(local)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_the_endpoint_is_the_configs_alone_never_one_from_the_environment(monkeypatch, variable):
    monkeypatch.setenv(variable, "http://127.0.0.1:9")  # a server the config never named
    aws = make_client(S3Config(region="us-east-1", **CREDS))
    assert aws.meta.endpoint_url == "https://s3.amazonaws.com", aws.meta.endpoint_url
    named = make_client(S3Config(endpoint_url="http://127.0.0.1:7", **CREDS))
    assert named.meta.endpoint_url == "http://127.0.0.1:7"
