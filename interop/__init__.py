"""sandflow with the tools people already have: exports and imports, one module per format.

    atif.py         export_atif     one ATIF trajectory (Harbor's RFC 0001) per episode
    inspect_log.py  export_inspect  Inspect AI eval logs (.eval), one per task set and mode
    hf.py           export_hf_run / export_hf_rlset / push_to_hub: Hugging Face dataset folders
    peer_import.py  import_peer     llm-in-sandbox 0.2.0 output folders -> a warehouse run

Shared parts: source.py (a run's episodes streamed out of the warehouse in batches, so a
run of 100,000 episodes never sits in memory), names.py (file names from hostile ids,
writes that never leave the output folder), summary.py (what each export carried and
what it could not).

A library: it is handed a warehouse root and folders, never reads the application's
settings, and prints nothing (sandflow/commands/interop.py is the CLI). The consumer
packages (harbor, inspect-ai) are never imported here: the formats are written as the
plain JSON/zip/Parquet their readers take, and the tests read them back with the real
packages (docs/interop.md says what maps to what).
"""
