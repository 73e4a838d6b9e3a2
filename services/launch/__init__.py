"""The launchers: the `specmesh` command, and the ways it runs the roles (every role in one
process, local child processes under a supervisor, one `specmesh serve ROLE` per container).

The role servers (router/, drafter/, datastore/, verifier/, the gateway) stay in their own
packages; this package only starts them.
"""
