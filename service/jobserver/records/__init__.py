"""What a job is, below everything that stores, runs or serves it: the spec users write
(``spec``), the record the ledger keeps (``record``) and the resources the API shows (``views``)."""
