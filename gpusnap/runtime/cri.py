"""A client of Kubernetes' CRI (runtime.v1) on a container runtime's socket.

The calls the kubelet makes to run a pod, checkpoint a container in it
(KEP-2008: `POST /checkpoint/{ns}/{pod}/{ctr}` on the kubelet becomes
CheckpointContainer) and restore one in another pod sandbox. containerd 2.1
and 2.2 restore through CreateContainer: where the container's image names a
checkpoint archive on the node (a file) or a checkpoint OCI image, the CRI
plugin creates the container from the checkpoint and StartContainer restores
it (internal/cri/server/container_checkpoint_linux.go, CRImportCheckpoint;
deprecated in containerd 2.3 and removed later for pod-level restore).

The version matrix's Kubernetes test (tests/integration/test_cri.py) drives
containerd through it as the kubelet would; nothing here is specific to
containerd but the restore note above.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from gpusnap.errors import GpusnapError
from gpusnap.proto import load
from gpusnap.proto.rpc import unary_stub

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
# containerd 2.1 reads this annotation on a checkpoint OCI image's index
# (checkpointctl's CheckpointAnnotationName) to restore from it.
CHECKPOINT_ANNOTATION = "io.kubernetes.cri-o.annotations.checkpoint.name"


class Cri:
    """The RuntimeService and ImageService of one CRI socket; methods raise GpusnapError."""

    def __init__(self, socket: str = CONTAINERD_SOCKET, timeout: float = 120.0) -> None:
        self.pb = load().cri
        self.socket = socket
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        pool = self.pb.DESCRIPTOR
        self._services = {name: pool.services_by_name[name] for name in ("RuntimeService", "ImageService")}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Cri":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, service: str, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary call; a gRPC failure becomes one line naming the call."""
        stub = unary_stub(self.channel, self._services[service], method)
        try:
            return stub(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.UNAVAILABLE:
                raise GpusnapError(f"no CRI runtime answers on {self.socket}: {detail}",
                                   "start containerd (2.x, with its CRI plugin) or pass its socket") from None
            raise GpusnapError(f"CRI {method} failed: {detail}") from None

    # RuntimeService

    def version(self) -> Any:
        return self.call("RuntimeService", "Version", self.pb.VersionRequest(version="v1"))

    def sandbox_config(self, name: str, namespace: str, uid: str, log_directory: str = "",
                       hostname: str = "") -> Any:
        """A PodSandboxConfig as the kubelet sends it for a pod (no host namespaces)."""
        pb = self.pb
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            hostname=hostname or name, log_directory=log_directory,
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                    "io.kubernetes.pod.uid": uid},
            linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD))))

    def run_pod(self, config: Any, runtime_handler: str = "") -> str:
        req = self.pb.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
        return self.call("RuntimeService", "RunPodSandbox", req).pod_sandbox_id

    def pod_status(self, pod_id: str) -> Any:
        req = self.pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id)
        return self.call("RuntimeService", "PodSandboxStatus", req).status

    def stop_pod(self, pod_id: str) -> None:
        self.call("RuntimeService", "StopPodSandbox", self.pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self.call("RuntimeService", "RemovePodSandbox", self.pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def create(self, pod_id: str, sandbox: Any, name: str, image: str, command: list[str] | None = None,
               log_path: str = "", labels: dict[str, str] | None = None) -> str:
        """CreateContainer; IMAGE may be a checkpoint archive's path or image (a restore)."""
        pb = self.pb
        config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name=name, attempt=0),
                                    image=pb.ImageSpec(image=image, user_specified_image=image),
                                    command=command or [], log_path=log_path, labels=labels or {})
        req = pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=sandbox)
        return self.call("RuntimeService", "CreateContainer", req).container_id

    def start(self, container_id: str) -> None:
        self.call("RuntimeService", "StartContainer", self.pb.StartContainerRequest(container_id=container_id))

    def status(self, container_id: str) -> Any:
        req = self.pb.ContainerStatusRequest(container_id=container_id)
        return self.call("RuntimeService", "ContainerStatus", req).status

    def status_info(self, container_id: str) -> dict:
        """The runtime's verbose details of a container (containerd: pid, runtimeType, ...)."""
        req = self.pb.ContainerStatusRequest(container_id=container_id, verbose=True)
        info = self.call("RuntimeService", "ContainerStatus", req).info.get("info", "{}")
        return json.loads(info)

    def containers(self, pod_id: str = "") -> list[Any]:
        req = self.pb.ListContainersRequest(filter=self.pb.ContainerFilter(pod_sandbox_id=pod_id))
        return list(self.call("RuntimeService", "ListContainers", req).containers)

    def checkpoint(self, container_id: str, location: str, timeout: int = 600) -> None:
        """CheckpointContainer: the container keeps running, its archive is written to LOCATION."""
        req = self.pb.CheckpointContainerRequest(container_id=container_id, location=location,
                                                 timeout=timeout)
        self.call("RuntimeService", "CheckpointContainer", req, timeout=timeout + 30)

    def stop(self, container_id: str, timeout: int = 10) -> None:
        req = self.pb.StopContainerRequest(container_id=container_id, timeout=timeout)
        self.call("RuntimeService", "StopContainer", req, timeout=timeout + 30)

    def remove(self, container_id: str) -> None:
        self.call("RuntimeService", "RemoveContainer", self.pb.RemoveContainerRequest(container_id=container_id))

    # ImageService

    def pull(self, image: str, sandbox: Any = None) -> str:
        req = self.pb.PullImageRequest(image=self.pb.ImageSpec(image=image), sandbox_config=sandbox)
        return self.call("ImageService", "PullImage", req).image_ref

    def image(self, image: str) -> Any:
        req = self.pb.ImageStatusRequest(image=self.pb.ImageSpec(image=image))
        return self.call("ImageService", "ImageStatus", req).image
