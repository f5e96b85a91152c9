"""Downloads: background tasks that fetch files (model pulls, engine installs).

`tasks` runs each task and announces its progress on the event bus; `fetch` gets one
file over one connection, `pieces` one big file over several. Outbound connections
go through localrt.outbound (proxy, SSL flags, hub token).
"""
