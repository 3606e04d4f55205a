"""`mars identity ensure-secrets`: the release's service identities, made in the cluster (the chart's Job)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from mars_tools.keys_cli import label_arg

console = Console(stderr=False)


def cmd_ensure_secrets(args: argparse.Namespace) -> int:
    from mars_tools.deploy.identity_secrets import IdentityPlan, ensure_identities, names_of
    from mars_tools.deploy.master_key_secret import ApiServer, SecretError

    try:
        labels = dict(label.split("=", 1) for label in args.label)
        plan = IdentityPlan(
            args.fullname, args.scope, names_of(args.name), args.days, labels, tuple(args.tls_host)
        )
        api = ApiServer.in_cluster(args.namespace)
        outcome = ensure_identities(api, plan, progress=lambda m: console.print(escape(m)))
    except (SecretError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    console.print(
        f"identities of {plan.scope}: {', '.join(outcome.renewed)} renewed ({plan.days} days); the CA bundle "
        f"holds {outcome.bundle} CA(s)" + (f"; new CA: {outcome.new_ca}" if outcome.new_ca else "")
    )
    if plan.tls_hosts:
        console.print(
            f"services' TLS: {plan.tls_secret} renewed for {len(plan.tls_hosts)} DNS names; its CA bundle holds "
            f"{outcome.tls_bundle} CA(s)" + (f"; new CA: {outcome.tls_new_ca}" if outcome.tls_new_ca else "")
        )
    return 0


def add_identity_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    identity = sub.add_parser(
        "identity",
        help="service identities (mars.identity): the release's CA and certificates",
        description="Every call to a stage service carries a token signed by a certificate of the identity CA "
        "whose SPIFFE ID (URI SAN) names the release and the caller.",
    )
    identity_sub = identity.add_subparsers(dest="identity_cmd", required=True)
    p = identity_sub.add_parser(
        "ensure-secrets",
        help="make the release's identity CA and certificates as Secrets (the chart's Job)",
        description="Inside a pod, with its service account: keeps (or makes) the identity CA in "
        "<fullname>-identity-ca-key, writes the CA bundle <fullname>-identity-ca, and mints every --name anew "
        "as <fullname>-identity-<name> (client authentication, SPIFFE ID <scope>/<name>, valid --days). "
        "Deleting <fullname>-identity-ca-key revokes every identity at the next run. None of these Secrets is "
        "in the release's manifest, so `helm rollback` never brings an old one back. Exit 1 when the API "
        "server refuses or an argument is wrong.",
    )
    p.add_argument("--fullname", required=True, help="the release's <fullname> (the Secrets' prefix)")
    p.add_argument("--scope", required=True, help="spiffe://<trust-domain>/ns/<namespace>/<release>")
    p.add_argument("--name", action="append", default=[], help="an identity to mint (repeatable)")
    p.add_argument("--days", type=int, default=90, help="each certificate's validity (default 90)")
    p.add_argument(
        "--tls-host",
        action="append",
        default=[],
        help="a DNS name of the services (repeatable): also make the services' TLS, a CA of its own in "
        "<fullname>-tls-ca-key and <fullname>-tls (tls.crt, tls.key, ca.crt) for these names",
    )
    p.add_argument("--namespace", default="", help="default: the pod's own namespace")
    p.add_argument(
        "--label", action="append", default=[], type=label_arg, help="NAME=VALUE label, repeatable"
    )
    p.set_defaults(func=cmd_ensure_secrets)
