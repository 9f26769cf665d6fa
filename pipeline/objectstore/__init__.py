"""Object-store targets: copies on S3-compatible storage (AWS S3, SeaweedFS, Ceph RGW, MinIO, R2).

``config`` parses ``[[targets]]`` (pure), ``keys`` names objects and their checksums (pure),
``client`` is the contract a storage worker has (put, confirm, get, read back, inventory,
delete), ``upload`` and ``download`` its transfers, ``faults`` one error per cause, ``probe``
whether a target works now (``ckpt target add``).
Importing the package imports no boto3 (only ``client``, ``upload``, ``download``,
``faults`` and ``probe`` need the optional extra ``s3``). docs/design.md, "Object-store targets".
"""
