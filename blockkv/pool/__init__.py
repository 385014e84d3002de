"""Blob pools: the ``BlobPool`` protocol (``protocol``) and its backends, one
module each: ``local`` (a directory), ``memory`` (tests), ``s3`` (a bucket)."""
