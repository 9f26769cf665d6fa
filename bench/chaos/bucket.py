"""The chaos soak's object store: SeaweedFS outside the box, a bucket on it, and what it holds.

The server runs in the soak's own network namespace on loopback (bench/seaweed.py, with an
identity: only the soak's key pair is accepted). The box reaches it only through the front on
its ``objstore`` host (bench/chaos/front.py, relaying to the server's unix socket), which the
faults throttle, stop or cut off; the checks here ask the server directly, so a fault on the
front never hides what the bucket holds, and they never ask the control plane's database:
an object counts once it is listed and its HeadObject checksum is its name's SHA-256 (a
multipart object's composite checksum proves nothing by itself: it is read and hashed).
The cluster in a box's ``chain+s3`` mode (bench/cluster.py) uses the same bucket and front.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from bench import seaweed
from pipeline.objectstore import keys

BUCKET, PREFIX = "chaos", "ckpt"
FRONT_PORT = 9000
TARGET = "store"
#: The run whose target mode is ``required``; the other (``sft``) lags, the default. Both modes in
#: every soak, under the same faults: ``required`` holds rotation until the bucket confirmed each
#: copy (a local deletion without them is unsafe), ``lag`` lets rotation go on and leaves the
#: copies to the sweep (they must all land after the heal, from a worker when the file is gone).
REQUIRED_RUN = "hf"


class SoakBucket:
    def __init__(self) -> None:
        # Not under the soak's root: a unix socket's path must stay short, and the server must
        # outlive nothing of the soak's (it is stopped and removed in :meth:`stop`).
        self.work = Path(tempfile.mkdtemp(prefix="ckpt-chaos-s3-"))
        self.server = seaweed.SeaweedFS(self.work, auth=True)
        self._client = None

    @property
    def socket(self) -> Path:
        return self.work / "s3.sock"

    def start(self) -> SoakBucket:
        self.server.start()
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def client(self):
        if self._client is None:
            self._client = boto3.client(
                "s3", endpoint_url=self.server.endpoint, region_name="us-east-1",
                aws_access_key_id=seaweed.ADMIN_KEY, aws_secret_access_key=seaweed.ADMIN_SECRET,
                config=BotoConfig(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30,
                                  retries={"mode": "standard", "total_max_attempts": 5}))
        return self._client

    def env(self, endpoint: str, home: Path) -> dict[str, str]:
        """What every process of the box needs for the target: ``CKPT_TARGETS`` (short timeouts and
        few attempts, so a partition is seen in seconds) and the standard AWS environment with
        the soak's key pair and nothing else to find (no shared files, no instance metadata)."""
        table = {"name": TARGET, "url": f"s3://{BUCKET}/{PREFIX}", "endpoint": endpoint, "region": "us-east-1",
                 "addressing_style": "path", "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10}
        return {"CKPT_TARGETS": json.dumps([table]), "AWS_ACCESS_KEY_ID": seaweed.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": seaweed.SECRET_KEY, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                "AWS_CONFIG_FILE": str(home / "no-aws-config")}

    @property
    def url(self) -> str:
        """The target's row url in the control plane (its id there is ``target:store``)."""
        return f"s3://{BUCKET}/{PREFIX}"

    def listing(self) -> dict[str, int]:
        """SHA-256 -> size of every object of the layout the bucket lists."""
        out = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/"):
            for o in page.get("Contents", []):
                sha = keys.sha_of(PREFIX, o["Key"])
                if sha is not None:
                    out[sha] = o["Size"]
        return out

    def proof(self, sha: str) -> str:
        """"" if the bucket holds the bytes named ``sha`` (HeadObject's checksum, or the bytes
        read back for a multipart object), else what is wrong."""
        key = keys.key_for(PREFIX, sha)
        try:
            head = self.client().head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
        except ClientError as e:
            return f"HeadObject {key}: {e.response.get('Error', {}).get('Code', '?')}"
        checksum = head.get("ChecksumSHA256") or ""
        if checksum == keys.full_checksum(sha):
            return ""
        if not keys.is_composite(checksum):
            return f"{key}: checksum {checksum or 'none'} is not its name's"
        h = hashlib.sha256()
        for chunk in self.client().get_object(Bucket=BUCKET, Key=key)["Body"].iter_chunks(1 << 20):
            h.update(chunk)
        return "" if h.hexdigest() == sha else f"{key}: its bytes hash to {h.hexdigest()[:12]}"

    def missing(self, shas: list[str], listed: dict[str, int] | None = None) -> list[str]:
        """What is wrong with each of ``shas`` on the bucket (not listed, or not proven)."""
        listed = self.listing() if listed is None else listed
        out = []
        for sha in shas:
            why = "not listed" if sha not in listed else self.proof(sha)
            if why:
                out.append(f"{sha[:12]}: {why}")
        return out
