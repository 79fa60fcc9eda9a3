"""Cloud provisioning for bamboo-launch: EC2 spot groups (boto3) and GCP managed
instance groups (google-cloud-compute), the wheel a launch ships, object storage for
it, the boot scripts nodes start with, and the commands that bring a job up, scale
and take it down. It sits above the commands: it builds a job's config with
bamboo-train's job spec and reads its state with bamboo-status."""
