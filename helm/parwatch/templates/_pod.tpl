{{/*
The pod both workloads share: the parwatch sidecar as a native sidecar (init container with
restartPolicy: Always, so the pod completes when the trainer exits) and the trainer.
Call with (dict "ctx" $ "trainerCommand" LIST).
*/}}

{{- define "parwatch.sidecarContainer" -}}
{{- $ := .ctx -}}
{{- $s := $.Values.sidecar -}}
- name: parwatch-sidecar
  image: {{ include "parwatch.image" (dict "ctx" $ "override" $s.image) }}
  imagePullPolicy: {{ include "parwatch.pullPolicy" (dict "ctx" $ "override" $s.image) }}
  restartPolicy: Always
  command: ["parwatch"]
  args:
    - sidecar
    - --rules=/etc/parwatch/rules.yaml
    - --state-dir={{ $s.stateDir.mountPath }}
    - --metrics-listen=0.0.0.0:{{ $s.metricsPort }}
    - --control-listen={{ ternary "0.0.0.0" "127.0.0.1" $s.exposeControl }}:{{ $s.controlPort }}
    {{- if $s.exposeControl }}
    # Every node's sidecar forwards its ranks' liveness and activity to the leader (pod 0) for hang
    # detection; the leader itself sees rank 0 and forwards nothing.
    - --leader-url=http://{{ include "parwatch.leaderHost" $ }}:{{ $s.controlPort }}
    {{- end }}
    {{- range $s.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    # The root file system is read-only: no bytecode caches, and HOME/TMPDIR in the state dir.
    - name: PYTHONDONTWRITEBYTECODE
      value: "1"
    - name: HOME
      value: {{ $s.stateDir.mountPath | quote }}
    - name: TMPDIR
      value: {{ $s.stateDir.mountPath | quote }}
    # The node, not the pod: the ranks report it as their host (the same variable, below), and this
    # sidecar checks the pids of the ranks of its host.
    - name: PARWATCH_HOST
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    # The control token by environment, not as a mounted file: the sidecar refuses a token file
    # that group or others can read, and fsGroup makes mounted Secret files group-readable.
    # `parwatch status` in this container reads it too.
    - name: PARWATCH_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "parwatch.tokenSecretName" $ }}
          key: {{ include "parwatch.tokenSecretKey" $ }}
    {{- with $s.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: metrics
      containerPort: {{ $s.metricsPort }}
      protocol: TCP
    {{- if $s.exposeControl }}
    - name: control
      containerPort: {{ $s.controlPort }}
      protocol: TCP
    {{- end }}
  startupProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 1
    timeoutSeconds: {{ $s.probes.timeoutSeconds }}
    failureThreshold: {{ $s.probes.startupFailureThreshold }}
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: {{ $s.probes.periodSeconds }}
    timeoutSeconds: {{ $s.probes.timeoutSeconds }}
    failureThreshold: {{ $s.probes.failureThreshold }}
  readinessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: {{ $s.probes.periodSeconds }}
    timeoutSeconds: {{ $s.probes.timeoutSeconds }}
    failureThreshold: {{ $s.probes.failureThreshold }}
  resources:
    {{- toYaml $s.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $s.runAsUser }}
    runAsGroup: {{ $s.runAsGroup }}
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  volumeMounts:
    - name: parwatch-state
      mountPath: {{ $s.stateDir.mountPath }}
    - name: parwatch-rules
      mountPath: /etc/parwatch
      readOnly: true
{{- end }}

{{- define "parwatch.trainerContainer" -}}
{{- $ := .ctx -}}
{{- $t := $.Values.training -}}
- name: {{ .containerName }}
  image: {{ include "parwatch.image" (dict "ctx" $ "override" $t.image) }}
  imagePullPolicy: {{ include "parwatch.pullPolicy" (dict "ctx" $ "override" $t.image) }}
  command:
    {{- toYaml .command | nindent 4 }}
  args:
    {{- range .launcherArgs }}
    - {{ . | quote }}
    {{- end }}
    - "-m"
    {{- if $t.parwatchArgs }}
    # The bundled trainer through parwatch's launcher, which attaches the collector.
    - "parwatch"
    - "train"
    {{- else }}
    - {{ $t.module | quote }}
    {{- end }}
    {{- range $t.args }}
    - {{ . | quote }}
    {{- end }}
    {{- if $t.parwatchArgs }}
    # The bundled trainer's flags: attach the collector, ship to the sidecar in this pod over loopback.
    - "--parwatch=on"
    - "--parwatch-endpoint={{ include "parwatch.controlEndpoint" $ }}"
    {{- if include "parwatch.tokenEnabled" $ }}
    - "--parwatch-token-file={{ include "parwatch.tokenDir" $ }}/token"
    {{- end }}
    {{- end }}
  env:
    # The same endpoint for trainers of your own and for `parwatch status` in this container.
    - name: PARWATCH_ENDPOINT
      value: {{ include "parwatch.controlEndpoint" $ | quote }}
    # The host the ranks report: the node's name, not the pod's (a container's hostname), so that
    # two pods of one node read as one host and their contention shows (docs/deploy.md).
    - name: PARWATCH_HOST
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    {{- if include "parwatch.tokenEnabled" $ }}
    - name: PARWATCH_TOKEN_FILE
      value: "{{ include "parwatch.tokenDir" $ }}/token"
    {{- end }}
    {{- with .env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .ports }}
  ports:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $t.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: dshm
      mountPath: /dev/shm
    {{- if include "parwatch.tokenEnabled" $ }}
    - name: parwatch-token
      mountPath: {{ include "parwatch.tokenDir" $ }}
      readOnly: true
    {{- end }}
    {{- with $t.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* Pod-level settings and volumes shared by the Job and the TrainingRuntime. */}}
{{- define "parwatch.podSettings" -}}
{{- $ := . -}}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ .Values.automountServiceAccountToken }}
# The sidecar checks its ranks' pids (a crash reads "gone" at once) and signals the culprit of a hang
# for its stacks: both need the trainer's processes in its view, which separate containers lack.
shareProcessNamespace: true
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: parwatch-state
    {{- if .Values.sidecar.stateDir.existingClaim }}
    persistentVolumeClaim:
      claimName: {{ .Values.sidecar.stateDir.existingClaim }}
    {{- else }}
    emptyDir:
      sizeLimit: {{ .Values.sidecar.stateDir.sizeLimit }}
    {{- end }}
  - name: parwatch-rules
    configMap:
      name: {{ default (printf "%s-rules" (include "parwatch.fullname" $)) .Values.sidecar.rules.existingConfigMap }}
  {{- if include "parwatch.tokenEnabled" $ }}
  - name: parwatch-token
    secret:
      secretName: {{ include "parwatch.tokenSecretName" $ }}
      defaultMode: 0444  # the trainer reads it, whatever its uid; only this pod mounts it
      items:
        - key: {{ include "parwatch.tokenSecretKey" $ }}
          path: token
  {{- end }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .Values.training.shmSize }}
  {{- with .Values.training.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{- define "parwatch.podMetadata" -}}
labels:
  {{- include "parwatch.labels" (dict "ctx" . "component" "training") | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
