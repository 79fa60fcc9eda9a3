"""bamboo-status: a job's state read from etcd, once or as a live dashboard served
over HTTP (the page, its charts, the run statistics beside them). It reads the
training command's metrics and reference; it writes nothing to the job."""
