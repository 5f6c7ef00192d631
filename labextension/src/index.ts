import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { extendLease, keepActive } from './actions';
import { IArtifact } from './api';
import { GpuLeaseModel } from './model';
import { GpuLeasePanel, PANEL_ID } from './panel';

const OPEN_COMMAND = 'gpulease:open-panel';

/** The status-bar item: "GPUs 3/4 free"; click or Enter opens the panel. */
class StatusItem extends Widget {
  constructor(
    private model: GpuLeaseModel,
    open: () => void
  ) {
    super({ node: document.createElement('button') });
    this.addClass('jp-GpuLease-statusItem');
    this.node.setAttribute('type', 'button');
    this.node.addEventListener('click', open);
    model.changed.connect(() => this.update(), this);
    this.update();
  }

  protected onUpdateRequest(): void {
    const m = this.model;
    let text = 'GPUs …';
    if (m.connection === 'unreachable') {
      text = 'GPUs: broker unreachable';
    } else if (m.info) {
      text = `GPUs ${m.info.summary.free}/${m.info.summary.total} free`;
    }
    this.node.textContent = text;
    this.node.setAttribute('aria-label', `${text}: open the GPU lease panel`);
    this.node.title = 'Open the GPU lease panel';
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpulease:plugin',
  description: 'GPUs, queue, leases and artifacts of the GPU lease broker, in the left sidebar',
  autoStart: true,
  optional: [ILabShell, IStatusBar],
  activate: (app: JupyterFrontEnd, labShell: ILabShell | null, statusBar: IStatusBar | null) => {
    const model = new GpuLeaseModel();

    const openArtifact = (a: IArtifact) => {
      if (a.relative_path === null) {
        return;
      }
      const log = a.files.includes('output.log') ? `${a.relative_path}/output.log` : null;
      void app.commands.execute('filebrowser:go-to-path', { path: a.relative_path });
      if (log) {
        void app.commands.execute('docmanager:open', { path: log });
      }
    };

    const panel = new GpuLeasePanel(model, openArtifact);
    app.shell.add(panel, 'left', { rank: 800 });

    app.commands.addCommand(OPEN_COMMAND, {
      label: 'Show GPU leases',
      execute: () => app.shell.activateById(PANEL_ID)
    });

    if (statusBar) {
      statusBar.registerStatusItem('jupyter-gpulease:status', {
        item: new StatusItem(model, () => void app.commands.execute(OPEN_COMMAND)),
        align: 'left',
        rank: 50
      });
    }

    // A warning before one of your leases is revoked for idleness or expires, with an Extend action.
    const notified = new Map<string, string>();
    model.warning.connect((_, event) => {
      const leaseId = String(event.lease_id ?? '');
      const key = `${event.kind}:${event.deadline}`;
      if (!leaseId || notified.get(leaseId) === key) {
        return;
      }
      const previous = notified.get(`${leaseId}#id`);
      if (previous) {
        Notification.dismiss(previous);
      }
      notified.set(leaseId, key);
      const what = event.kind === 'idle' ? 'revoked for idleness' : 'expire';
      const id = Notification.warning(event.message ?? `GPU lease ${leaseId} will ${what} soon`, {
        autoClose: false,
        actions: [
          {
            label: event.kind === 'idle' ? 'Keep it' : 'Extend…',
            caption: event.kind === 'idle' ? `Mark lease ${leaseId} in use` : `Extend lease ${leaseId}`,
            callback: () => {
              const lease = model.leases.find(l => l.id === leaseId);
              if (event.kind === 'idle') {
                void keepActive(model, leaseId);
              } else if (lease) {
                void extendLease(model, lease);
              } else {
                Notification.error(`Lease ${leaseId} has ended: nothing to extend.`, { autoClose: 8000 });
              }
            }
          },
          {
            label: 'Show',
            displayType: 'link',
            callback: () => void app.commands.execute(OPEN_COMMAND)
          }
        ]
      });
      notified.set(`${leaseId}#id`, id);
    });

    model.start();
  }
};

export default plugin;
