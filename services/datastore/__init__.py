"""The lookup datastore (SSSD): suffix-array datastore, prompt + self-output index, fusion, service."""
