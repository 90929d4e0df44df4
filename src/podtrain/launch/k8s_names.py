"""Kubernetes' rules for the names and quantities ``launch k8s`` writes into a manifest, checked
before anything is written: a name or quantity Kubernetes would refuse is one line naming the flag,
not a failed ``kubectl apply`` after the job was generated."""

from __future__ import annotations

import argparse
import re

from podtrain.errors import UserError

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE])?$")
"""A memory quantity as Kubernetes parses one (``32Gi``, ``500M``), without signs or exponents."""


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          **{f"{p}i": 2**(10 * (i + 1)) for i, p in enumerate("KMGTPE")}}


def quantity_bytes(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity that ``_QUANTITY`` accepts (``32Gi``, ``500M``, ``1.5Gi``)."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    number = match[1] if not match[1].startswith(".") else "0" + match[1]
    return int(float(number) * _UNITS[match[3] or ""])


def k8s_name(name: str, flag: str, label: bool = False) -> str:
    """``name`` checked as Kubernetes checks an object's name: a DNS subdomain (at most 253
    characters; claims, service accounts) or, with ``label``, a DNS label (at most 63, no '.';
    namespaces). A name it refuses is one line here, not a failed ``kubectl apply``."""
    pattern, limit, chars = (_LABEL, 63, "'-'") if label else (_SUBDOMAIN, 253, "'-' and '.'")
    if len(name) > limit or not pattern.match(name):
        raise UserError(f"{flag} {name!r} is not a valid Kubernetes name (lower case letters, digits, "
                        f"{chars}, starting and ending with a letter or digit, at most {limit} characters)")
    return name


def service_account(name: str) -> str:
    """``--service-account NAME`` checked as Kubernetes checks it (``k8s_name``): the pods get AWS
    credentials from it through IRSA or EKS Pod Identity."""
    return k8s_name(name, "--service-account")


def check_names(args: argparse.Namespace) -> None:
    """The flags that become Kubernetes names or quantities, checked before anything is written."""
    if args.pvc is not None:
        k8s_name(args.pvc, "--pvc")
    if args.namespace is not None:
        k8s_name(args.namespace, "--namespace", label=True)
    if args.service_account is not None:
        service_account(args.service_account)
    if not _QUANTITY.match(args.shm_size):
        raise UserError(f"--shm-size {args.shm_size!r} is not a Kubernetes quantity (e.g. 32Gi, 500Mi)")
