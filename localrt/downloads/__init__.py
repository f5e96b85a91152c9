"""Downloads: background tasks that fetch files (model pulls, engine installs).

`tasks` runs each task and announces its progress on the event bus; `fetch` gets one
file over one connection, `pieces` one big file over several; `opener` builds the
outbound urllib opener from the Config (proxy, SSL flags, hub token).
"""
