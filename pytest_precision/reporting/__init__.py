"""What a run reports from its records:

- ``summary``: the terminal summary;
- ``declarations``: the block of declarations a run found its targets need;
- ``report``: the JSON and Markdown reports;
- ``plots``: the figures;
- ``merge``: several machines' reports in one table."""
