"""`embedserve batch`: embed a whole corpus through a running embedserve server.

An OpenAI batch file (JSONL of `{"custom_id", "method", "url", "body"}`) or a table (Parquet,
JSONL, CSV) goes in; the OpenAI batch result file, or the table's ids and vectors, come out, in
input order, each row once, resumable after a kill. docs/bulk.md describes the command.

    inputs.py    reading and checking the input, row by row
    grouping.py  table rows into requests within the server's limits
    server.py    the server's limits (/info) and the sizes derived from them
    retry.py     which answers are retried, and how long to wait
    client.py    one request through the service, with retries
    outputs.py   the result writers (batch JSONL, table JSONL, Parquet parts)
    resume.py    what an earlier run wrote, and cutting a torn end away
    runner.py    the bounded, ordered pipeline between them
    progress.py  the progress bar or log lines, and the summary
    cli.py       the command line
"""
