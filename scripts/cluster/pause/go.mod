module pdpool.local/pause

go 1.22
